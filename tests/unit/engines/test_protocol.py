"""GenerateRequest refuses a tree or coupled request that does not say where its response starts
(the default 0 took the whole prompt for response: its tokens entered the prompt's draft tree and
the coupled noise positions counted from the prompt's first token).
"""

import pytest
from megatron_specrl.engines.protocol import GenerateRequest

@pytest.mark.parametrize("kw", [{"draft_key": "p"}, {"coupled_seed": 7}])
def test_tree_and_coupled_requests_need_response_start(kw):
    with pytest.raises(ValueError, match="need response_start"):
        GenerateRequest([5, 6, 7], 4, **kw)
    assert GenerateRequest([5, 6, 7], 4, response_start=3, **kw).response_start == 3


def test_plain_request_defaults_to_response_start_zero_and_bounds_are_checked():
    assert GenerateRequest([5, 6, 7], 4).response_start == 0
    with pytest.raises(ValueError, match="response_start=4 is outside the 3-token prompt_ids"):
        GenerateRequest([5, 6, 7], 4, draft_key="p", response_start=4)
    with pytest.raises(ValueError, match="outside"):
        GenerateRequest([5, 6, 7], 4, response_start=-1)
