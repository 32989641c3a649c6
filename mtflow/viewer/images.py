"""The images of a trajectory, for the viewers: which message each one entered with (its
``<image>`` placeholder), its name in the run directory, and a small thumbnail.

A trajectory line names its images (``images``: ``images/<sha256>.png`` relative to the run
directory, in placeholder order; :mod:`mtflow.run.images`). The HTML page embeds each as a
thumbnail (at most :data:`THUMB` pixels a side, PNG, inline so the page stays one file) linked
to the full-size file; ``trace show --detail`` names them under their message.
"""
from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from mtflow.core.images import IMAGE_TOKEN

__all__ = ['THUMB', 'image_refs', 'per_message', 'thumbnails']

#: the longest side of a thumbnail, in pixels
THUMB = 96


def image_refs(traj: Any) -> List[str]:
    """The run-relative names of a trajectory's images (``[]`` for a text-only one)."""
    refs = (getattr(traj, 'extra', None) or {}).get('images') or []
    return [str(r) for r in refs] if isinstance(refs, list) else []


def per_message(traj: Any) -> List[List[int]]:
    """For each message, the indices (into :func:`image_refs`) of the images its placeholders show."""
    out, k = [], 0
    for m in traj.messages:
        content = m.get('content') if isinstance(m, dict) else None
        n = content.count(IMAGE_TOKEN) if isinstance(content, str) else 0
        out.append(list(range(k, k + n)))
        k += n
    return out


def _thumb(path: Path) -> Optional[str]:
    try:
        from PIL import Image
        with Image.open(path) as img:
            img.thumbnail((THUMB, THUMB))
            buf = io.BytesIO()
            img.convert('RGBA' if img.mode in ('RGBA', 'LA', 'P') else 'RGB').save(buf, format='PNG')
    except Exception:  # a missing or unreadable file: the page says so instead of a picture
        return None
    return 'data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode('ascii')


def thumbnails(traj: Any, run_dir: Optional[Path], page_dir: Optional[Path]) -> List[Dict[str, Any]]:
    """One entry per image of ``traj``: ``name`` (its run-relative name), ``thumb`` (a data URL,
    ``None`` when the file cannot be read) and ``href`` (the full-size file, relative to the page)."""
    out = []
    for ref in image_refs(traj):
        path = (run_dir / ref) if run_dir is not None else Path(ref)
        href = os.path.relpath(path, page_dir) if page_dir is not None else str(path)
        out.append({'name': ref, 'thumb': _thumb(path), 'href': href})
    return out
