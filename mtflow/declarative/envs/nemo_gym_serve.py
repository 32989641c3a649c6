"""Serve one NeMo Gym resources server on 127.0.0.1 (run by path, in the Python that has
``nemo-gym``: ``python nemo_gym_serve.py package.module:ServerClass PORT [NAME]``).

NeMo Gym's own ``run_webserver`` needs its whole run (a head server, a global Hydra config, Ray);
a resources server's app itself needs only its config and a server client it never calls for the
plain tool and verify routes, which is how NeMo Gym's own tests build one. This file imports no
mtflow module: it runs in NeMo Gym's venv (Python 3.13), apart from mtflow's.
"""
import importlib
import sys


def build_app(ref: str, name: str):
    from unittest.mock import MagicMock

    from nemo_gym.server_utils import ServerClient

    module, attr = ref.split(':', 1)
    cls = getattr(importlib.import_module(module), attr)
    config_cls = cls.model_fields['config'].annotation
    config = config_cls(host='127.0.0.1', port=0, entrypoint='', name=name)
    server = cls(config=config, server_client=MagicMock(spec=ServerClient))
    app = server.setup_webserver()
    app.get('/health')(lambda: {'status': 'ok'})
    return app


def main(argv):
    import uvicorn

    ref, port = argv[0], int(argv[1])
    name = argv[2] if len(argv) > 2 else ref.split(':', 1)[1]
    uvicorn.run(build_app(ref, name), host='127.0.0.1', port=port, log_level='warning')


if __name__ == '__main__':
    main(sys.argv[1:])
