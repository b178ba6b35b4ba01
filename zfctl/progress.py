"""How `zfctl finetune` shows the trainer's events while a run goes: the renderers.

Three renderers of the same events: a Rich Live dashboard on a terminal, plain lines every
``steps_per_print`` steps otherwise, one JSON object per event with ``--json`` (strict
JSON, ``zenflow.jsonout``); ranks other than 0 show nothing. Without the dashboard, Hugging
Face's progress bars are off (``quiet_hugging_face``): with ``--json`` stderr holds only
zfctl's own messages. What is drawn is ``zfctl.dashboard``'s pure functions; this module
owns only the loop around them, and never starts or checks a run.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from zenflow.train.learning import weights_text
from zfctl.dashboard import (
    DashboardState,
    event_to_json,
    format_plain_header,
    format_plain_line,
    reference_text,
    render_dashboard,
)


def choose_renderer(rank: int, json_output: bool, no_dashboard: bool, out: Console,
                    steps_per_print: int | None):  # fmt: skip
    """The renderer for this process: rank 0 reports (JSON, the live dashboard on a
    terminal, else plain lines); the others say only their own error."""
    if rank != 0:  # data parallel: rank 0 reports; the others say only their own error
        return SilentRenderer()
    if json_output:
        return JsonRenderer()
    if out.is_terminal and not no_dashboard:
        return LiveRenderer(out)
    return PlainRenderer(steps_per_print or 10)


def _signal_notice(message: str) -> None:
    """A repeated Ctrl-C/SIGTERM's notice ("already stopping: ..."). Called inside the
    signal handler (zenflow.train.signals): one unbuffered write to stderr, because the
    handler may have interrupted a write to a buffered stream."""
    try:
        os.write(2, f"{message}\n".encode("utf-8", "replace"))
    except OSError:
        pass  # stderr closed: the stop goes on regardless


def quiet_hugging_face(errors_only: bool) -> None:
    """No Hugging Face progress bars on stderr ("Loading weights", "Writing model shards"
    of transformers, huggingface_hub's downloads, datasets' maps) where they are noise:
    plain lines, a log file, ``--json``. ``errors_only`` (``--json``, ranks > 0): their
    warnings too (transformers' logger, DeepSpeed's, and the libraries' FutureWarnings about
    their own APIs), so stderr holds zfctl's own messages alone."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' bars, and huggingface_hub's
    if errors_only:
        hf_logging.set_verbosity_error()
        # DeepSpeed's warnings ("Setting accelerator to CPU") go to stdout, into the JSON
        # stream; a filter, because importing deepspeed later resets its logger's level
        logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning)
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:  # read once, when datasets is imported (only some tasks' data need it)
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


class SilentRenderer:
    """Ranks other than 0 of a data-parallel run: nothing to show (and the base of the
    renderers without a live display: a context manager that does nothing)."""

    already_finished = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __call__(self, event) -> None:
        return None


class JsonRenderer(SilentRenderer):
    """One JSON object per event on stdout, nothing else."""

    signal_notice = staticmethod(_signal_notice)

    def __call__(self, event) -> None:
        self.already_finished |= type(event).__name__ == "RunAlreadyFinished"
        sys.stdout.write(event_to_json(event) + "\n")
        sys.stdout.flush()


class PlainRenderer(SilentRenderer):
    """Plain lines (not a terminal): the header, every ``every`` steps, evals, the end."""

    signal_notice = staticmethod(_signal_notice)

    def __init__(self, every: int):
        self.every = max(1, int(every))
        self.state = DashboardState()

    @property
    def already_finished(self) -> bool:
        return self.state.already_finished

    def __call__(self, event) -> None:
        self.state.apply(event)
        kind = type(event).__name__
        if kind == "RunStarted":
            for line in format_plain_header(self.state.header):
                print(line, flush=True)
        elif kind == "StepEvent":
            s = self.state
            if s.step % self.every == 0 or s.step == s.total_steps or s.step == 1:
                print(format_plain_line(s), flush=True)
        elif kind == "EvalEvent":
            metrics = ", ".join(
                f"{k} {v:.4f}" for k, v in event.metrics.items() if isinstance(v, float)
            )
            vs = reference_text(self.state, event.step, dict(event.metrics))
            seen = weights_text(dict(event.metrics))
            print(f"eval at step {event.step}: {metrics}" + (f" ({seen})" if seen else "")
                  + (f" | {vs}" if vs else ""), flush=True)  # fmt: skip


class LiveRenderer:
    """Rich Live dashboard: render_dashboard(state) after every event."""

    signal_notice = staticmethod(_signal_notice)

    def __init__(self, console: Console):
        from rich.live import Live

        self.state = DashboardState()
        self.live = Live(console=console, refresh_per_second=4, transient=False)

    @property
    def already_finished(self) -> bool:
        return self.state.already_finished

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def __call__(self, event) -> None:
        self.state.apply(event)
        if self.state.header:
            self.live.update(
                render_dashboard(self.state), refresh=type(event).__name__ != "StepEvent"
            )
