"""``mtflow check-tokens`` on a vision-language model: the tiny random Qwen2-VL saved as a model
directory, its processor built in Python (``--processor tests.tiny_vlm:make_vl_processor``: no
processor files, which transformers 5.19 reads and writes through torchvision). A conversation
that shows the model a new frame every turn passes every check; one whose turn-2 step swaps the
turn-1 frame for another picture of the same size (same ids, other pixels) fails the images check."""
from __future__ import annotations

import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow.cli import main  # noqa: E402
from tests.tiny_vlm import make_vlm  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope='module')
def vlm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp('tiny-vlm')
    model, _ = make_vlm(seed=2)
    model.save_pretrained(d)
    return str(d)


def check(vlm_dir, scheduler, capsys):
    code = main(['check-tokens', '--model', vlm_dir, '--processor', 'tests.tiny_vlm:make_vl_processor',
                 '--scheduler', f'tests.multimodal.fixtures:{scheduler}', '--limit', '2', '--max-turns', '3'])
    return code, capsys.readouterr().out


def row(out, check_name):
    return [line for line in out.splitlines() if line.strip('│ ').startswith(check_name)][0]


def test_passes_on_a_multimodal_conversation(vlm_dir, capsys):
    code, out = check(vlm_dir, 'Pictures', capsys)
    assert code == 0, out
    assert '1 of 1 template/policy runs passed every check' in out
    images = row(out, 'images').split('│')
    assert images[2].strip() == '4' and images[3].strip() == '0'  # 2 requests x 2 transitions, none failed
    assert row(out, 'prefix').split('│')[3].strip() == '0'


def test_fails_on_a_tampered_one(vlm_dir, capsys):
    code, out = check(vlm_dir, 'SwappedPictures', capsys)
    assert code == 1
    assert row(out, 'images').split('│')[3].strip() == '2'  # each request's turn 3 shows another turn-1 frame
    assert 'FAIL images:' in out and 'turn 3: the images of turn 2 changed' in out


def test_processor_errors_are_one_line(vlm_dir, capsys):
    assert main(['check-tokens', '--processor', 'tests.tiny_vlm:make_vl_processor']) == 2
    assert '--processor needs --model to be the directory of a vision-language model' in capsys.readouterr().err
    assert main(['check-tokens', '--model', vlm_dir, '--processor', 'tests.tiny_vlm:nothing']) == 2
    assert "--processor 'tests.tiny_vlm:nothing'" in capsys.readouterr().err
