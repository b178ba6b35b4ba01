"""`zfctl finetune`'s flag checks: the combinations a parser cannot see, refused with exit 2.

Each check names the flags involved and what to do instead (``zfctl.errors.user_error``);
none reads a file, loads a model or starts anything, so a wrong command line stops before
the run. The command itself (options, the run's steps) lives in ``zfctl.finetune``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from zfctl.errors import user_error

ENGINES = ("zenflow", "offload", "device", "deepspeed", "lora")
DEVICES = ("cpu", "cuda", "sim")
INITS = ("pretrained", "random")


def check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise user_error(f"{flag} {value!r} is not allowed; choose one of {', '.join(allowed)}.")
    return value


def check_positive(flag: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise user_error(f"{flag} must be positive, got {value}.")


def check_flags(flags: SimpleNamespace) -> str | None:
    """The checks that come before anything starts (the ranks of --nproc included), in
    the order their messages are given; returns the run's task name (``data_flags``)."""
    check_choice("--engine", flags.engine, ENGINES)
    lora_flags(flags.engine, flags.lora_rank, flags.lora_alpha)
    check_choice("--init", flags.init, INITS)
    objective_flags(flags.objective, flags.data, flags.resume, flags.text_field,
                    flags.label_field, flags.tsv_quoting, flags.pack, flags.prompt_field,
                    flags.completion_field, flags.messages_field)  # fmt: skip
    task = data_flags(flags.task, flags.data, flags.eval_data, flags.text_field,
                      flags.label_field, flags.tsv_quoting, flags.resume,
                      flags.sample_data)  # fmt: skip
    if flags.device is not None:
        check_choice("--device", flags.device, DEVICES)
    return task


def lora_flags(engine: str, rank: int | None, alpha: float | None) -> list[str]:
    """--lora-rank / --lora-alpha: checked, and as the config overrides they stand for
    (``zfctl.lora.rank`` / ``zfctl.lora.alpha``); they set --engine lora's adapters only."""
    given = [flag for flag, v in (("--lora-rank", rank), ("--lora-alpha", alpha)) if v is not None]
    if given and engine != "lora":
        raise user_error(f"{' and '.join(given)} set(s) the adapters of --engine lora, not of "
                         f"--engine {engine}; add --engine lora, or drop them.")  # fmt: skip
    check_positive("--lora-alpha", alpha)
    sets = [f"zfctl.lora.rank={rank}"] if rank is not None else []
    return sets + ([f"zfctl.lora.alpha={alpha}"] if alpha is not None else [])


def check_sim_profile(sim_profile: str | None, device: str | None) -> None:
    """--sim-profile scales the simulated link: it needs --device sim and a known profile."""
    if sim_profile is None:
        return
    from zenflow.engine.accelerator.profiles import PROFILES

    if device != "sim":
        raise user_error("--sim-profile needs --device sim (it scales the simulated link).")
    check_choice("--sim-profile", sim_profile, tuple(PROFILES))


def data_flags(task, data, eval_data, text_field, label_field, tsv_quoting, resume,
               sample_data) -> str | None:  # fmt: skip
    """Check --task / --data and the flags that only mean something with --data; return
    the run's task name (a --data run is named by --task, else by its file)."""
    if data is None:
        flags = (("--eval-data", eval_data), ("--text-field", text_field),
                 ("--label-field", label_field), ("--tsv-quoting", tsv_quoting))  # fmt: skip
        given = [flag for flag, value in flags if value]
        if given:
            raise user_error(f"{', '.join(given)} describe(s) a --data table; pass --data FILE "
                             "(your training table) or drop them.")  # fmt: skip
        if task is None and resume is None:
            raise user_error("Pass --task GLUE_TASK (e.g. --task sst2) or --data FILE (your own "
                             "table: .jsonl, .json, .csv, .tsv or .parquet).")  # fmt: skip
        return task
    if sample_data:
        raise user_error("--sample-data replaces GLUE's SST-2 files; it does not go with --data.")
    if text_field is not None and not 1 <= len(text_field) <= 2:
        raise user_error(f"--text-field was given {len(text_field)} times; give one text column, "
                         "or two for sentence pairs.")  # fmt: skip
    if tsv_quoting is not None:
        check_choice("--tsv-quoting", tsv_quoting, ("csv", "none"))
    if task is None:  # the run's name: the file's, or the dataset id's, made path-safe
        from zenflow.train.run_match import data_run_name  # what a resume recognises too

        task = data_run_name(data)
    return task


def data_location(path: Path | None) -> str | None:
    """A --data/--eval-data file made absolute (a resumed run, from any folder, reads the
    same file), or a hub dataset id (zenflow.train.data.hub) as given."""
    from zenflow.train.data import is_hub_id

    if path is None:
        return None
    if is_hub_id(path):
        return str(path)
    try:
        return str(path.expanduser().resolve())
    except (RuntimeError, OSError):  # a symlink loop: RuntimeError before Python 3.13
        raise user_error(f"{path} is a symbolic link loop (following its links comes back to "
                         "itself); point the link at the data file, or pass the file "
                         "itself.") from None  # fmt: skip


def objective_flags(objective, data, resume, text_field, label_field, tsv_quoting, pack,
                    prompt_field, completion_field, messages_field) -> None:  # fmt: skip
    """Check --objective and the flags that belong to one objective only."""
    from zenflow.train.data import OBJECTIVES

    check_choice("--objective", objective, OBJECTIVES)
    lm_flags = (("--pack", pack), ("--prompt-field", prompt_field),
                ("--completion-field", completion_field),
                ("--messages-field", messages_field))  # fmt: skip
    if objective == "classification":
        given = [flag for flag, value in lm_flags if value]
        if given:
            raise user_error(f"{', '.join(given)} describe(s) causal-LM records; add "
                             "--objective causal-lm, or drop them.")  # fmt: skip
        return
    if data is None and resume is None:
        raise user_error("--objective causal-lm trains on your records: pass --data FILE "
                         "(.jsonl or .json: text, prompt/completion or messages).")  # fmt: skip
    given = [flag for flag, value in (("--label-field", label_field),
                                      ("--tsv-quoting", tsv_quoting)) if value]  # fmt: skip
    if given:
        raise user_error(f"{', '.join(given)} describe(s) a classification table, not "
                         "causal-LM records; drop them.")  # fmt: skip
    if text_field is not None and len(text_field) != 1:
        raise user_error("--objective causal-lm reads one text field; give --text-field once.")
