"""Packing keeps every sample whole and exact: its ids, its positions (restarting at 0), its loss
mask, its advantage and rollout logprobs, for random lengths (hypothesis); and a packed row with the
block-causal mask gives a real model the same logprobs as each sample alone."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtflow.train import Sample
from mtflow.train.packing import block_causal_mask, pack, pad, to_tensors, unpack


@st.composite
def batches(draw):
    row_len = draw(st.integers(min_value=2, max_value=48))
    n = draw(st.integers(min_value=0, max_value=12))
    samples = []
    for k in range(n):
        total = draw(st.integers(min_value=2, max_value=row_len))
        p = draw(st.integers(min_value=1, max_value=total - 1))
        c = total - p
        mask = draw(st.lists(st.integers(0, 1), min_size=c, max_size=c))
        lps = [-(k + 1) - j / 100 if m else 0.0 for j, m in enumerate(mask)]
        samples.append(Sample(uuid=f'r{k}', group=f'g{k % 3}', reward=float(k), prompt_ids=[1000 + k] * p,
                              completion_ids=[2000 + 100 * k + j for j in range(c)], loss_mask=mask, logprobs=lps,
                              advantage=k / 10 - 0.3))
    return samples, row_len


def _check_rows(rows, samples, row_len):
    placed = {}
    for r, row in enumerate(rows):
        assert all(len(getattr(row, f)) == row_len for f in ('input_ids', 'position_ids', 'loss_mask',
                                                             'sample_index', 'advantages', 'logprobs'))
        for k, index in enumerate(row.sample_index):
            if index < 0:  # padding: never trained, positions 0
                assert row.loss_mask[k] == 0 and row.position_ids[k] == 0 and row.advantages[k] == 0.0
        # each sample is one contiguous stretch, in the order of row.samples, ending at cu_seqlens
        order = [i for k, i in enumerate(row.sample_index) if i >= 0 and (k == 0 or row.sample_index[k - 1] != i)]
        assert order == row.samples and len(set(order)) == len(order)
        for index, part in unpack(row).items():
            assert index not in placed  # never split over two rows
            placed[index] = r
            s = samples[index]
            n = len(s.prompt_ids) + len(s.completion_ids)
            assert part['input_ids'] == s.prompt_ids + s.completion_ids
            assert part['position_ids'] == list(range(n))
            assert part['loss_mask'] == [0] * len(s.prompt_ids) + s.loss_mask
            start = row.sample_index.index(index)
            body = slice(start + len(s.prompt_ids), start + n)
            assert row.logprobs[body] == s.logprobs
            assert row.advantages[body] == [s.advantage if m else 0.0 for m in s.loss_mask]
        used = [c for c in row.cu_seqlens]
        assert used == [0] + [sum(len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in row.samples[:j])
                              for j in range(1, len(row.samples) + 1)]
    assert sorted(placed) == list(range(len(samples)))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_packing_keeps_every_sample_exactly(batch):
    samples, row_len = batch
    rows = pack(samples, row_len)
    _check_rows(rows, samples, row_len)
    assert sum(sum(r.loss_mask) for r in rows) == sum(s.trained_tokens for s in samples)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_padded_rows_keep_every_sample_exactly(batch):
    samples, _ = batch
    rows = pad(samples)
    width = max((len(s.input_ids) for s in samples), default=0)
    assert len(rows) == len(samples)
    _check_rows(rows, samples, width)


def test_a_sample_longer_than_a_row_is_refused_naming_it():
    s = Sample(uuid='long#1', group='g', reward=0.0, prompt_ids=[1] * 5, completion_ids=[2] * 6, loss_mask=[1] * 6,
               segment=2)
    with pytest.raises(ValueError, match='request long#1, segment 2: 11 tokens do not fit a row of 10'):
        pack([s], 10)


def test_a_packed_row_gives_the_model_each_samples_own_logprobs():
    torch = pytest.importorskip('torch')
    from tests.tiny_model import make_model, make_tokenizer

    model = make_model(make_tokenizer())
    samples = [Sample(uuid=f'r{k}', group='g', reward=0.0, prompt_ids=[1, 5 + k], completion_ids=ids,
                      loss_mask=[1] * len(ids)) for k, ids in enumerate([[7, 9, 11], [20, 30], [40, 41, 42, 43]])]
    batch = to_tensors(pack(samples, row_len=20))
    assert batch['input_ids'].shape == (1, 20)
    logits = model(batch['input_ids'], attention_mask=block_causal_mask(batch['sample_index']),
                   position_ids=batch['position_ids']).logits
    for k, s in enumerate(samples):
        alone = model(torch.tensor([s.input_ids])).logits[0]
        where = (batch['sample_index'][0] == k).nonzero()[:, 0]
        assert torch.allclose(logits[0, where], alone, atol=1e-5)
