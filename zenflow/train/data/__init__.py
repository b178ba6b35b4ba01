"""zenflow.train.data: where a run's rows come from, and how they become batches.

One module per source, each implementing ``source.DataSource`` (``load`` -> the task, the
train and eval rows, their source and the header lines):

- ``glue``: GLUE's tasks (presets of the table reader) and a synthetic SST-2 sample;
- ``tables``: a user's table (``.jsonl``, ``.json``, ``.csv``, ``.tsv``, ``.parquet``);
- ``sft``: text, prompt/completion or chat records for a causal LM;
- ``hub``: a hub dataset's split (``NAME[:CONFIG][@SPLIT]``), read by ``tables`` and
  ``sft`` as they read a file.

The shared pieces: ``readers`` (files -> records, UTF-8 decoding), ``records`` (SFT record
kinds and fields), ``labels`` (label sets), ``task`` (a classification task and its
examples), ``reports`` (the header's counts), ``encoding`` (classification examples ->
fixed-length tensors, truncation), ``record_encoding`` (records -> ids with loss labels,
truncation), ``packing`` (rows, packed or not), ``batching`` (the eval split, epoch order,
micro-batches), ``metrics`` (the tasks' metrics) and ``lm_scoring`` (a causal LM's loss and
evaluation).

Arrows run one way: the sources build on the shared pieces; ``source`` imports nothing here.
"""

from zenflow.train.data.batching import (
    batches,
    epoch_permutation,
    eval_batches,
    seeded_split,
    steps_per_epoch,
)
from zenflow.train.data.encoding import Encoded, encode, is_truncated, truncation_line
from zenflow.train.data.glue import (
    GLUE_TASKS,
    GlueSource,
    get_task,
    load_task,
    task_files,
    write_sst2_sample,
)
from zenflow.train.data.hub import hub_fingerprint, is_hub_id
from zenflow.train.data.labels import LabelSet, infer_labels
from zenflow.train.data.lm_scoring import (
    completion_logprob,
    evaluate_lm,
    lm_eval_metrics,
    lm_loss,
    loss_tokens,
    score_completions,
    token_loss_sum,
)
from zenflow.train.data.metrics import (
    METRICS,
    accuracy,
    compute_metrics,
    f1,
    matthews,
    metrics_for,
    pearson,
    spearman,
)
from zenflow.train.data.packing import (
    PACKING_MODEL_TYPES,
    SFTData,
    check_packing_support,
    pack_examples,
    packed_attention_mask,
)
from zenflow.train.data.record_encoding import (
    IGNORE,
    Tokenised,
    encode_chat,
    encode_prompt_completion,
)
from zenflow.train.data.records import (
    CHAT,
    PROMPT_COMPLETION,
    TEXT,
    RecordFields,
    read_records,
    records_from,
)
from zenflow.train.data.sft import (
    LMData,
    LMTask,
    RecordSource,
    build_sft,
    choice_set,
    eval_rows,
    load_lm_data,
    load_sft,
)
from zenflow.train.data.source import OBJECTIVES, DataSource, Rows, SourceData, Task
from zenflow.train.data.tables import TableSource, load_table_task, read_rows
from zenflow.train.data.task import Example, GlueTask, Preset, TaskData

__all__ = [
    "CHAT",
    "GLUE_TASKS",
    "IGNORE",
    "METRICS",
    "OBJECTIVES",
    "PACKING_MODEL_TYPES",
    "PROMPT_COMPLETION",
    "TEXT",
    "DataSource",
    "Encoded",
    "Example",
    "GlueSource",
    "GlueTask",
    "LMData",
    "LMTask",
    "LabelSet",
    "Preset",
    "RecordFields",
    "RecordSource",
    "Rows",
    "SFTData",
    "SourceData",
    "TableSource",
    "Task",
    "TaskData",
    "Tokenised",
    "accuracy",
    "batches",
    "build_sft",
    "check_packing_support",
    "choice_set",
    "completion_logprob",
    "compute_metrics",
    "encode",
    "encode_chat",
    "encode_prompt_completion",
    "epoch_permutation",
    "eval_batches",
    "eval_rows",
    "evaluate_lm",
    "f1",
    "get_task",
    "hub_fingerprint",
    "infer_labels",
    "is_hub_id",
    "is_truncated",
    "lm_eval_metrics",
    "lm_loss",
    "load_lm_data",
    "load_sft",
    "load_table_task",
    "load_task",
    "loss_tokens",
    "matthews",
    "metrics_for",
    "pack_examples",
    "packed_attention_mask",
    "pearson",
    "read_records",
    "read_rows",
    "records_from",
    "score_completions",
    "seeded_split",
    "spearman",
    "steps_per_epoch",
    "task_files",
    "token_loss_sum",
    "truncation_line",
    "write_sst2_sample",
]
