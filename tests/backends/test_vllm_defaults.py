"""The vLLM engine settings chosen from the hardware (``mtflow/backends/vllm_defaults.py``): the
dtype from the CPU's flags or the GPU, the CPU block size, and the user's own values winning."""
from mtflow.backends.vllm_defaults import CPU_BLOCK_SIZE, CPU_KV_CACHE_BYTES, choose_dtype, choose_engine_kwargs, cpu_flags
from mtflow.run.engine_figures import engine_rows, engine_settings

AVX2 = frozenset({'sse4_2', 'avx', 'avx2', 'fma'})


def test_float32_on_a_cpu_without_bf16_instructions_bfloat16_with_them():
    assert choose_dtype('cpu', AVX2)[0] == 'float32'
    assert choose_dtype('cpu', AVX2 | {'avx512f', 'avx512bw'})[0] == 'float32', 'AVX-512 alone emulates bf16'
    assert choose_dtype('cpu', AVX2 | {'avx512f', 'avx512_bf16'}) == ('bfloat16', 'CPU with avx512_bf16')
    assert choose_dtype('cpu', AVX2 | {'amx_bf16', 'amx_tile'})[0] == 'bfloat16'
    assert choose_dtype('cuda', frozenset())[0] == 'auto', "a GPU runs the model's dtype"


def test_the_users_engine_kwargs_win_and_the_report_says_where_each_value_came_from():
    kwargs, report = choose_engine_kwargs({'max_model_len': 512}, 'cpu', AVX2)
    assert kwargs == {'max_model_len': 512, 'dtype': 'float32', 'block_size': CPU_BLOCK_SIZE,
                      'kv_cache_memory_bytes': CPU_KV_CACHE_BYTES}
    assert report['dtype_why'].startswith('CPU without') and 'CPU default' in report['block_size_why']
    kwargs, report = choose_engine_kwargs({'dtype': 'bfloat16', 'block_size': 128, 'kv_cache_memory_bytes': 5}, 'cpu',
                                          AVX2)
    assert kwargs == {'dtype': 'bfloat16', 'block_size': 128, 'kv_cache_memory_bytes': 5}
    assert report['dtype_why'] == report['block_size_why'] == 'engine_kwargs'
    kwargs, report = choose_engine_kwargs(None, 'cuda', frozenset())
    assert kwargs == {'dtype': 'auto'}, "on a GPU vLLM's block size stays"
    assert choose_engine_kwargs({'seed': 1}, None)[0] == {'seed': 1}, 'an unknown platform: nothing chosen'


def test_the_summary_rows_say_the_settings(tmp_path):
    _, report = choose_engine_kwargs({}, 'cpu', AVX2)

    class Backend:
        load_info = report

    rows = dict(engine_rows(engine_settings(Backend), None))
    assert rows['engine'].startswith('dtype float32 (CPU without avx512_bf16/amx_bf16') and \
        f'block_size {CPU_BLOCK_SIZE}' in rows['engine']
    assert engine_settings(object()) is None and engine_rows(None, None) == []


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / 'cpuinfo'
    info.write_text('processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2 amx_bf16\n')
    assert cpu_flags(str(info)) == {'fpu', 'avx2', 'amx_bf16'}
    assert cpu_flags(str(tmp_path / 'missing')) == frozenset()
