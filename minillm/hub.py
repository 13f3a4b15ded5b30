"""Models by name: `REPO[:QUANT]` on the Hugging Face Hub, fetched into its local cache.

    minillm generate bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M -p "..."
    minillm.load("bartowski/SmolLM2-135M-Instruct-GGUF")          # Q4_K_M, else Q8_0, else the first

huggingface_hub does the transfers and the cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE, HF_ENDPOINT;
resumable downloads into `.incomplete` files renamed only when whole). This module chooses the
file as llama.cpp's `-hf` does, refuses what minillm cannot run before downloading it, checks
each new file's sha256 against the hub's, and keeps the store: `local_models` (minillm ls) and
`remove` (minillm rm). A model's last use is its blob's access time, set on each use.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import MinillmError
from .gguf_file import SPLIT_NAME

# REPO[:QUANT], optionally written as a hub address (hf.co/REPO:QUANT, as Ollama takes it)
_REF = re.compile(r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?([\w.-]+/[\w.-]+?)(?::([\w.-]+))?$")
_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")  # a file's quantization tag: the last word of its name
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when no QUANT is named, then the first file
# formats minillm runs, as tags name them (Q4_K_M and Q4_K_L are Q4_K files with some tensors wider)
_RUNNABLE = re.compile(r"^(F32|F16|BF16|Q8_0|Q4_0|Q4_1|Q5_0|Q5_1|Q[2-6]_K(_[A-Z]+)?)$")
_FORMAT_LIKE = re.compile(r"^(I?Q\d|TQ\d|MXFP\d|NVFP\d|F\d|BF\d)")
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # llama.cpp's list


@dataclass(frozen=True)
class ModelRef:
    repo: str                   # owner/name
    quant: str | None = None    # the quantization tag asked for (case-insensitive)
    filename: str | None = None  # a file named outright (-hff)

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "") + (f" ({self.filename})" if self.filename else "")


@dataclass(frozen=True)
class HubFile:
    path: str                   # in the repository
    size: int | None
    sha256: str | None          # the LFS object id: the file's sha256


def parse_ref(text: str, filename: str | None = None) -> ModelRef:
    """REPO[:QUANT] (or hf.co/REPO[:QUANT]) as a ModelRef; a clear error if it is not one."""
    m = _REF.match(str(text).strip())
    if m is None or m.group(1).endswith(".gguf"):
        raise MinillmError(f"{text!r} is neither a file nor a model on the hub (owner/name[:QUANT])")
    quant = m.group(2)
    if quant is not None and filename is None:
        check_quant(quant)
    return ModelRef(m.group(1), quant, filename)


def looks_like_ref(text: str) -> bool:
    m = _REF.match(str(text).strip())
    return m is not None and not m.group(1).endswith(".gguf")


def quant_tag(path: str) -> str:
    """The quantization tag of a GGUF file name, upper-case ('' if none), split suffix removed."""
    name = path.rsplit("/", 1)[-1]
    name = name[:-5] if name.lower().endswith(".gguf") else name
    split = SPLIT_NAME.match(name + ".gguf")
    m = _TAG.search(split.group(1) if split else name)
    return m.group(1).upper() if m else ""


def runnable_tag(tag: str) -> bool:
    return bool(_RUNNABLE.match(tag.upper()))


def check_quant(quant: str) -> None:
    """Refuse, by name, a QUANT that names a format minillm does not run (IQ4_XS, TQ1_0, ...)."""
    tag = quant.upper()
    if _FORMAT_LIKE.match(tag) and not runnable_tag(tag):
        raise MinillmError(f"{quant}: minillm does not run this format; it runs F32, F16, BF16, Q8_0, Q4_0, "
                           "Q4_1, Q5_0, Q5_1 and the K-quants Q2_K to Q6_K (Q4_K_M, Q5_K_S, ...)")


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(word in name.lower() for word in _NOT_MODELS)


def split_parts(files: list[HubFile], first: HubFile) -> list[HubFile]:
    """first and the other parts of its split model, in order ([first] if it is whole)."""
    m = SPLIT_NAME.match(first.path)
    if m is None:
        return [first]
    names = {f"{m.group(1)}-{i:05d}-of-{m.group(3)}.gguf" for i in range(1, int(m.group(3)) + 1)}
    parts = sorted((f for f in files if f.path in names), key=lambda f: f.path)
    if len(parts) != len(names):
        raise MinillmError(f"{first.path} is one of {len(names)} split files, but the repository holds {len(parts)}")
    return parts


def choose_file(files: list[HubFile], ref: ModelRef) -> HubFile:
    """The model file ref names (llama.cpp's rule: the first file whose name carries the tag, or
    with no tag Q4_K_M, then Q8_0, then the first file minillm can run); for a split model, its
    first part."""
    models = [f for f in files if is_model_file(f.path)
              and (SPLIT_NAME.match(f.path) is None or SPLIT_NAME.match(f.path).group(2) == "00001")]
    if ref.filename is not None:
        found = [f for f in files if f.path == ref.filename]
        if not found:
            raise MinillmError(f"{ref.repo} has no file {ref.filename}{_listing(models, files)}")
        return found[0]
    if not models:
        raise MinillmError(f"{ref.repo} holds no GGUF model file{_listing(models, files)}; minillm runs GGUF files "
                           "(llama.cpp's convert_hf_to_gguf.py makes one from a safetensors model)")
    for tag in (ref.quant,) if ref.quant else DEFAULT_TAGS:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        for f in models:
            if pattern.search(f.path.rsplit("/", 1)[-1]):
                return f
    if ref.quant:
        raise MinillmError(f"{ref.repo} has no {ref.quant} file{_listing(models, files)}")
    runnable = [f for f in models if runnable_tag(quant_tag(f.path))]
    if not runnable:
        raise MinillmError(f"{ref.repo} has no file in a format minillm runs{_listing(models, files)}")
    return runnable[0]


def _listing(models: list[HubFile], files: list[HubFile]) -> str:
    shown = [f.path for f in (models or files)][:12]
    more = len(models or files) - len(shown)
    return (": it has " + ", ".join(shown) + (f" and {more} more" if more > 0 else "")) if shown else " (it is empty)"


# ---------------------------------------------------------------------------------------------
# the hub and its cache
# ---------------------------------------------------------------------------------------------
def _hub():
    """huggingface_hub, imported on first use (the CLI starts without it)."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.utils
    except ImportError:  # pragma: no cover - a dependency of the package
        raise MinillmError("models by name need huggingface_hub: pip install huggingface_hub") from None
    return huggingface_hub


def _offline() -> bool:
    return _hub().constants.HF_HUB_OFFLINE


def _repo_folder(repo: str) -> Path:
    return Path(_hub().constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))


def _listing_online(ref: ModelRef):
    """((commit, files, architecture or None), None) from the hub; (None, why) if it cannot be
    reached."""
    hub = _hub()
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    try:
        info = hub.HfApi().model_info(ref.repo, files_metadata=True)
    except GatedRepoError:
        raise MinillmError(f"{ref.repo} is gated: accept its conditions on its page of the hub, then set HF_TOKEN "
                           "to an access token of that account") from None
    except RepositoryNotFoundError:
        token = " (HF_TOKEN is set: it may not have access)" if hub.get_token() else " (a private one needs HF_TOKEN)"
        raise MinillmError(f"no model repository {ref.repo} on the hub{token}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        if status in (401, 403):
            raise MinillmError(f"the hub refused access to {ref.repo} (HTTP {status}): check HF_TOKEN") from None
        if isinstance(status, int) and status >= 500:
            return None, str(exc).splitlines()[0]
        raise MinillmError(f"the hub answered HTTP {status} for {ref.repo}") from None
    except OfflineModeIsEnabled:
        return None, "HF_HUB_OFFLINE is set"
    except Exception as exc:
        if not _transport_error(exc):
            raise
        return None, f"{type(exc).__name__}: {exc}"
    files = [HubFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None)
             for s in info.siblings or []]
    architecture = (info.gguf or {}).get("architecture") if isinstance(info.gguf, dict) else None
    return (info.sha, files, architecture), None


def _transport_error(exc: Exception) -> bool:
    """A failure to reach the hub or to read its answer (refused, reset, timed out, cut short),
    as huggingface_hub's HTTP client raises it."""
    return isinstance(exc, (OSError, ConnectionError, TimeoutError)) or \
        type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2")


def _listing_cached(ref: ModelRef):
    """(commit, files) of the cached copy of ref's repository (its main branch), or None."""
    folder = _repo_folder(ref.repo)
    try:
        commit = (folder / "refs" / "main").read_text().strip()
    except OSError:
        snapshots = sorted((folder / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) \
            if (folder / "snapshots").is_dir() else []
        if not snapshots:
            return None
        commit = snapshots[-1].name
    root = folder / "snapshots" / commit
    files = [HubFile(p.relative_to(root).as_posix(), p.stat().st_size, None)
             for p in sorted(root.rglob("*")) if p.is_file()]
    return (commit, files) if files else None


def _check_architecture(ref: ModelRef, architecture: str | None) -> None:
    if architecture is None:
        return  # the hub did not say: the loader checks after the download
    from .arch import ARCHITECTURES

    if architecture not in ARCHITECTURES:
        raise MinillmError(f"{ref.repo} is a '{architecture}' model, which minillm does not run "
                           f"(it runs {', '.join(sorted(ARCHITECTURES))})")


def _download(ref: ModelRef, commit: str, f: HubFile, offline: bool, cached: bool) -> Path:
    """One file into the cache, its sha256 checked when it is new (not cached before)."""
    hub = _hub()
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(hub.hf_hub_download(ref.repo, f.path, revision=commit, local_files_only=offline))
    except LocalEntryNotFoundError:
        raise MinillmError(f"{ref.repo}/{f.path} is not in the local cache and the hub cannot be reached") from None
    except Exception as exc:
        if not _transport_error(exc):
            raise
        raise MinillmError(f"downloading {ref.repo}/{f.path} failed: {str(exc).splitlines()[0]}") from None
    if cached or f.sha256 is None:
        return path
    with open(path, "rb") as file:
        actual = hashlib.file_digest(file, "sha256").hexdigest()
    if actual != f.sha256:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise MinillmError(f"{ref.repo}/{f.path}: the downloaded file's sha256 is {actual}, the hub's is "
                           f"{f.sha256}; the file is deleted: try again")
    return path


def fetch(ref: ModelRef, quiet: bool = False, log=None) -> Path:
    """The local path of the model ref names (a split model's first part), downloaded into the
    cache if it is not there. Offline (HF_HUB_OFFLINE=1, or the hub unreachable) the cached copy
    serves. log(line): what is downloaded, and why the cache serves; quiet: no progress bar
    (huggingface_hub's, on stderr)."""
    log = log or (lambda line: None)
    hub = _hub()
    offline = _offline()
    listing, why_offline = (None, None) if offline else _listing_online(ref)
    if listing is not None:
        commit, files, architecture = listing
        _check_architecture(ref, architecture)
    else:
        cached = _listing_cached(ref)
        if cached is None:
            why = why_offline or "HF_HUB_OFFLINE is set"
            raise MinillmError(f"{ref} is not in the local cache, and the hub cannot be used ({why})")
        commit, files = cached
        if why_offline:
            log(f"notice: the hub cannot be reached ({why_offline}); using the cached copy")
        offline = True
    first = choose_file(files, ref)
    parts = split_parts(files, first)
    if quiet:
        hub.utils.disable_progress_bars()
    cached = [isinstance(hub.try_to_load_from_cache(ref.repo, p.path, revision=commit), str) for p in parts]
    if not offline and not all(cached):
        size = sum(p.size or 0 for p in parts)
        log(f"downloading {ref.repo}/{first.path}" + (f" ({len(parts)} parts)" if len(parts) > 1 else "")
            + (f", {size / 2**20:.1f} MiB" if size else ""))
    paths = [_download(ref, commit, p, offline, was_cached) for p, was_cached in zip(parts, cached)]
    for path in paths:
        mark_used(path)
    return paths[0]


def mark_used(path: Path) -> None:
    """Record a use: the blob's access time (what `ls` shows as last used)."""
    try:
        blob = Path(path).resolve()
        os.utime(blob, (time.time(), blob.stat().st_mtime))
    except OSError:
        pass


def in_cache(path: Path) -> bool:
    """Whether path lies in the hub's cache (where nothing but downloads should be written)."""
    try:
        return Path(path).absolute().is_relative_to(Path(_hub().constants.HF_HUB_CACHE).absolute())
    except MinillmError:
        return False


def resolve_model(model: str | os.PathLike | None, hf_repo: str | None = None, hf_file: str | None = None,
                  quiet: bool = False, log=None) -> Path:
    """What a command's MODEL names: a path that exists, as it is; else REPO[:QUANT] (or -hf
    REPO[:QUANT], -hff FILE) from the hub (see fetch)."""
    if hf_repo is not None or hf_file is not None:
        if model is not None:
            raise MinillmError("give a model file or -hf REPO, not both")
        if hf_repo is None:
            raise MinillmError("-hff names a file of the repository that -hf names: give -hf too")
        return fetch(parse_ref(hf_repo, hf_file), quiet, log)
    if model is None:
        raise MinillmError("no model: give a .gguf file, REPO[:QUANT] or -hf REPO[:QUANT]")
    path = Path(model)
    if path.exists() or not looks_like_ref(str(model)):
        return path
    return fetch(parse_ref(str(model)), quiet, log)


# ---------------------------------------------------------------------------------------------
# the local store: ls and rm
# ---------------------------------------------------------------------------------------------
@dataclass
class LocalModel:
    repo: str
    file: str                   # in the repository (a split model: its first part)
    size: int                   # bytes, all parts
    architecture: str
    quantization: str
    last_used: float            # seconds since the epoch
    path: Path

    def ref(self) -> str:
        return f"{self.repo}:{quant_tag(self.file)}" if quant_tag(self.file) else self.repo


def local_models() -> list[LocalModel]:
    """The GGUF models in the hub cache, most recently used first."""
    cache = Path(_hub().constants.HF_HUB_CACHE)
    found = []
    for folder in sorted(cache.glob("models--*--*")):
        repo = folder.name[len("models--"):].replace("--", "/", 1)
        for snapshot in sorted((folder / "snapshots").glob("*")):
            files = {p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*.gguf") if p.exists()}
            hub_files = [HubFile(name, p.stat().st_size, None) for name, p in files.items()]
            for f in hub_files:
                split = SPLIT_NAME.match(f.path)
                if not is_model_file(f.path) or (split and split.group(2) != "00001"):
                    continue
                try:
                    parts = split_parts(hub_files, f)
                except MinillmError:
                    continue  # a split model not wholly downloaded
                found.append(_describe(repo, f.path, [files[p.path] for p in parts]))
    return sorted(found, key=lambda m: -m.last_used)


def _describe(repo: str, name: str, paths: list[Path]) -> LocalModel:
    from .gguf_file import peek_metadata
    from .quantize.ftypes import FILE_TYPES_BY_ID

    facts = peek_metadata(paths[0], ("general.architecture", "general.file_type"))
    ftype = facts.get("general.file_type")
    quantization = FILE_TYPES_BY_ID[ftype].name if ftype in FILE_TYPES_BY_ID else quant_tag(name) or "?"
    blobs = [p.resolve() for p in paths]
    return LocalModel(repo, name, sum(b.stat().st_size for b in blobs), str(facts.get("general.architecture", "?")),
                      quantization, max(b.stat().st_atime for b in blobs), paths[0])


def remove(ref: ModelRef) -> list[tuple[str, int]]:
    """Delete ref's files from the cache (with no QUANT, the whole repository): [(file, bytes)]."""
    folder = _repo_folder(ref.repo)
    if not folder.is_dir():
        raise MinillmError(f"{ref.repo} is not in the local store (`minillm ls` lists what is)")
    if ref.quant is None and ref.filename is None:
        removed = [(f"{m.file}", m.size) for m in local_models() if m.repo == ref.repo]
        shutil.rmtree(folder)
        return removed or [(ref.repo, 0)]
    chosen = [m for m in local_models() if m.repo == ref.repo and
              (m.file == ref.filename if ref.filename else quant_tag(m.file) == ref.quant.upper())]
    if not chosen:
        raise MinillmError(f"{ref} is not in the local store (`minillm ls` lists what is)")
    removed = []
    for m in chosen:
        snapshot = Path(str(m.path)[:-len(m.file)])
        parts = split_parts([HubFile(p.relative_to(snapshot).as_posix(), None, None)
                             for p in snapshot.rglob("*.gguf")], HubFile(m.file, None, None))
        for part in parts:
            link = snapshot / part.path
            blob = link.resolve()
            link.unlink()
            if blob != link and not _still_linked(folder, blob):
                blob.unlink(missing_ok=True)
        removed.append((m.file, m.size))
    return removed


def _still_linked(folder: Path, blob: Path) -> bool:
    return any(p.resolve() == blob for p in (folder / "snapshots").rglob("*") if p.is_symlink())
