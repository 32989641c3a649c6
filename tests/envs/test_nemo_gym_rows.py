"""NeMo Gym's JSONL rows read as they are (no NeMo Gym needed): the conversation from
``responses_create_params.input``, its tools as the request's, the whole row in ``data_dict``; a row
that is not one is a line-numbered error."""
from __future__ import annotations

import json
import re

import pytest

from mtflow.data import DatasetError, read_prompts

ROW = {'id': 3, 'responses_create_params': {
    'input': [{'role': 'developer', 'content': 'Be brief.'},
              {'role': 'user', 'content': [{'type': 'input_text', 'text': 'add 1'}], 'type': 'message'}],
    'tools': [{'type': 'function', 'name': 'increment_counter', 'strict': True, 'description': 'Add.',
               'parameters': {'type': 'object', 'properties': {'count': {'type': 'integer'}}}}]},
    'expected_count': 4}


def test_a_nemo_gym_row_is_a_request(tmp_path):
    path = tmp_path / 'rows.jsonl'
    path.write_text(json.dumps(ROW) + '\n')
    (req, ) = read_prompts(path)
    assert req.uuid == '3' and req.messages == [{'role': 'system', 'content': 'Be brief.'},
                                                {'role': 'user', 'content': 'add 1'}]
    assert req.tools == [{'type': 'function', 'function': {
        'name': 'increment_counter', 'description': 'Add.',
        'parameters': {'type': 'object', 'properties': {'count': {'type': 'integer'}}}}}]
    assert req.data_dict == ROW  # the server reads the row back (seed_session, verify), its id included


@pytest.mark.parametrize('params, message', [
    ({'input': []}, 'responses_create_params.input must be a non-empty list of messages'),
    ({'input': ['hi']}, 'responses_create_params.input[0] is not a message with a role'),
])
def test_a_row_that_is_not_one_names_its_line(tmp_path, params, message):
    path = tmp_path / 'rows.jsonl'
    path.write_text(json.dumps(ROW) + '\n' + json.dumps({'responses_create_params': params}) + '\n')
    with pytest.raises(DatasetError, match=re.escape(f'rows.jsonl:2: {message}')):
        read_prompts(path)
