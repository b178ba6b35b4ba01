"""Saving a fine-tuned model: ``save_model`` writes the model (and tokenizer) with
save_pretrained and turns a write failure into a ``StorageError`` that names the directory.

Writes only into the directory it is given; what goes into a run directory, and when, is
the trainer's.
"""

from __future__ import annotations

import os
from pathlib import Path

from zenflow.errors import StorageError, os_error_message


def _not_deepspeed_accelerator_guess(record) -> bool:
    return "Setting accelerator to CPU" not in record.getMessage()


def save_model(model, tokenizer, out: Path) -> None:
    """save_pretrained the model (and tokenizer) into ``out``; a write failure (disk full,
    read-only) raises StorageError naming ``out`` and the free space. safetensors reports
    I/O errors as SafetensorError("... (os error 28)"), so the errno is read from its text."""
    import errno
    import logging
    import re

    # save_pretrained asks accelerate (installed with peft, --engine lora) to unwrap the
    # model, which imports DeepSpeed; without a GPU its import logs "Setting accelerator to
    # CPU" on stdout, into --json output. DeepSpeed's logger (by name, made at its import)
    # drops that one record.
    logging.getLogger("DeepSpeed").addFilter(_not_deepspeed_accelerator_guess)
    try:
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    except OSError as exc:
        raise StorageError(os_error_message(exc, out, "cannot save the model to")) from exc
    except Exception as exc:
        m = re.search(r"os error (\d+)", str(exc))
        if m is None or int(m.group(1)) not in errno.errorcode:
            raise  # not an I/O failure: a bug, reported as one
        code = int(m.group(1))
        err = OSError(code, os.strerror(code))
        raise StorageError(os_error_message(err, out, "cannot save the model to")) from exc
