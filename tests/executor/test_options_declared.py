"""The executor's options are declared once (``ExecutorOptions``): the signature cannot drift."""
import inspect
from dataclasses import MISSING, fields

import mtflow
from mtflow.engine.executor import OPTION_NAMES
from mtflow.engine.options import ExecutorOptions


def test_the_signature_names_every_option_with_its_default():
    params = {n: p for n, p in inspect.signature(mtflow.Executor.__init__).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(params) - {'image_store'} == set(OPTION_NAMES)
    for f in fields(ExecutorOptions):
        assert f.default is not MISSING and params[f.name].default == f.default, f.name


def test_removed_attribute_passthrough_is_an_attribute_error():
    ex = mtflow.Executor(type('S', (mtflow.Scheduler, ), {'step': lambda self, r, c, t: {'infer_request': r}})(),
                         lambda requests, config=None: [])
    assert ex.options.rank == 0
    assert not hasattr(ex, 'rank')
