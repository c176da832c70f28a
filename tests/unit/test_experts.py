from __future__ import annotations

import pytest

from pytest_layerparity.replay.experts import gathered_bytes, lazy_experts

MOE = {"hidden_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}


def test_batched_mm_gathers_each_tokens_top_k_experts_weights():
    # 32 tokens x 2 experts, each expert's gate, up and down projections (3 x 64 x 32), 2 bytes each
    assert gathered_bytes(MOE, 32, 2) == 32 * 2 * 3 * 64 * 32 * 2
    assert gathered_bytes({"text_config": MOE}, 32, 2) == 32 * 2 * 3 * 64 * 32 * 2
    assert gathered_bytes({"hidden_size": 64, "intermediate_size": 256}, 32, 2) == 0  # no experts


@pytest.mark.parametrize(
    ("free", "chosen", "why"),
    [
        (4 * 1_572_864, "batched_mm", "batched_mm (static shapes: one graph per layer kind; it gathers 1.57 MB"),
        (4 * 1_572_864 - 1, "eager", "eager (batched_mm would gather 1.57 MB of expert weights per call, over 25%"),
        (None, "eager", "eager (this device's free memory is unknown"),
    ],
)
def test_static_experts_where_their_gathered_weights_fit_a_quarter_of_the_free_memory(free, chosen, why):
    implementation, text = lazy_experts(MOE, 64, 2, free)
    assert implementation == chosen
    assert text.startswith(why)


def test_a_model_without_experts_says_nothing_of_them():
    assert lazy_experts({"hidden_size": 64, "intermediate_size": 256}, 32, 2, 10**9) == ("eager", "")
