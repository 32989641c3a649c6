"""Run one vLLM engine through mtflow's backend and exit: the script the opt-in log test
(``tests/backends/test_vllm_real_logs.py``) starts in a subprocess, so that the engine's whole
output is read as a user sees it (its engine-core and worker processes write to the same
stdout/stderr, and vLLM's ``warning_once`` is once per process).

    python tests/backends/vllm_engine_run.py MODEL_DIR {llm,async} DTYPE

Also prints ``mtflow-run: worker grace S`` (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` in the
engine core's own environment, ``/proc/PID/environ``: what its executor waits for the workers
before SIGTERM) and, last, ``mtflow-run: ok`` after ``close()`` returned."""
import multiprocessing
import sys
import time

from mtflow import RequestConfig, RolloutInferRequest
from mtflow.backends.vllm_engine import VLLMBackend


def _worker_grace(before: set) -> str:
    for proc in multiprocessing.active_children():
        if proc in before:
            continue
        with open(f'/proc/{proc.pid}/environ', 'rb') as f:
            env = dict(item.split(b'=', 1) for item in f.read().split(b'\0') if b'=' in item)
        return env.get(b'VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS', b'unset (5)').decode()
    return 'no engine process'


def main(path: str, engine: str, dtype: str) -> None:
    kwargs = {'dtype': dtype, 'max_model_len': 256, 'enforce_eager': True, 'kv_cache_memory_bytes': 64 << 20}
    before = set(multiprocessing.active_children())
    backend = VLLMBackend(path, engine=engine, engine_kwargs=kwargs)
    print(f'mtflow-run: worker grace {_worker_grace(before)}', flush=True)
    requests = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'guess {i}'}], uuid=f'r{i}')
                for i in range(2)]
    outs = backend(requests, RequestConfig(temperature=0, max_tokens=4))
    assert all(o.response.choices[0].token_ids for o in outs), outs
    start = time.monotonic()
    backend.close()
    print(f'mtflow-run: close {time.monotonic() - start:.1f} s', flush=True)
    print('mtflow-run: ok', flush=True)


if __name__ == '__main__':
    main(*sys.argv[1:4])
