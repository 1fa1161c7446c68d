"""MFU's FLOP count credits attention with the keys each query really attends to in packed rows."""

import pytest
import torch

from harness.metrics import mean_attended_keys
from models.qwen35_moe import get_flavor
from models.qwen35_moe.args import FULL_ATTENTION
from models.qwen35_moe.flops import training_flops_per_token


def test_attention_is_counted_per_query_by_its_own_documents_keys():
    args = get_flavor("35B-A3B")
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])  # documents of 3, 5 and 8 tokens
    # Written out: forward QK^T and PV are 2 + 2 FLOPs per (query, key, head dim, head); training is 3x forward.
    per_query = [4 * args.num_attention_heads * args.head_dim * (p + 1) * 3 for p in positions.flatten().tolist()]
    want = args.num_layers_of(FULL_ATTENTION) * sum(per_query) / positions.numel()
    attended = mean_attended_keys(positions)
    assert attended == (6 + 15 + 36) / 16
    assert training_flops_per_token(args, attended) - training_flops_per_token(args, 0) == pytest.approx(want)
    # A row of one document: causal, each query sees half the row on average, not all of it.
    assert mean_attended_keys(torch.arange(4096)[None]) == 4097 / 2


def test_a_trained_mtp_layer_adds_its_fc_block_and_a_second_lm_head_pass():
    """35B-A3B's MTP layer, counted by hand: fc 2 * 2048^2; gated attention q (with its gate) 2048 * 16 * 256 * 2,
    k and v 2 * 2048 * 2 * 256, o 16 * 256 * 2048; MoE router 2048 * 256, 8 experts of 3 * 2048 * 512, the shared
    expert 3 * 2048 * 512 and its gate 2048; the lm_head 2048 * 248,320: 573,048,832 matmul parameters a token
    touches, x6 for training, plus its attention over the keys each query attends to."""
    args = get_flavor("35B-A3B")
    assert args.mtp_num_hidden_layers == 1
    matmul = 2 * 2048**2 + 2048 * 16 * 256 * 2 + 2 * 2048 * 2 * 256 + 16 * 256 * 2048
    matmul += 2048 * 256 + 8 * 3 * 2048 * 512 + 3 * 2048 * 512 + 2048 + 2048 * 248_320
    assert matmul == 573_048_832
    attended = 1000.5
    extra = training_flops_per_token(args, attended, mtp=True) - training_flops_per_token(args, attended)
    assert extra == pytest.approx(6 * matmul + 12 * 16 * 256 * attended)
