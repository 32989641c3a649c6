"""The weight-dtype summary filter of ``mtflow.backends.vllm_logs`` on a plain logger (no vLLM):
vLLM's per-tensor records are held back and become one line with their count, written before the
next record that passes."""
import logging

from mtflow.backends.vllm_logs import WEIGHT_DTYPE_MESSAGE, WeightDtypeSummary


class Collect(logging.Handler):

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_per_tensor_warnings_become_one_line_before_the_next_record():
    logger = logging.getLogger('vllm-test.model_executor.models.utils')
    logger.propagate = False
    handler = Collect()
    handler.addFilter(WeightDtypeSummary())
    logger.addHandler(handler)
    try:
        for name in ('embed_tokens.weight', 'norm.weight', 'lm_head.weight'):
            logger.warning(WEIGHT_DTYPE_MESSAGE, name, 'torch.float32', 'torch.bfloat16')
        logger.warning(WEIGHT_DTYPE_MESSAGE, 'x.weight', 'torch.float16', 'torch.bfloat16')
        assert handler.lines == []
        logger.warning('Loading weights took %.2f seconds', 0.01)
        assert handler.lines == [
            "4 weights loaded into parameters of another dtype and cast (1 from torch.float16 into torch.bfloat16, "
            "3 from torch.float32 into torch.bfloat16); vLLM's 4 'Attempted to load weight' warnings summarised by "
            'mtflow', 'Loading weights took 0.01 seconds']
        logger.warning('another line')
        assert handler.lines[-1] == 'another line' and len(handler.lines) == 3
    finally:
        logger.removeHandler(handler)
