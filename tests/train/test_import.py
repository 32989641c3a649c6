"""``import mtflow.train`` stays as light as ``import mtflow``: torch is imported by the functions
that need it, never by the package."""
import subprocess
import sys


def test_import_mtflow_train_stays_light():
    code = ('import sys, mtflow.train, mtflow.train.weights, mtflow.train.packing, mtflow.train.staleness; '
            'print([m for m in ("torch", "transformers", "vllm", "swift", "trl") if m in sys.modules])')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == '[]'
