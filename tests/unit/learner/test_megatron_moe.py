"""`megatron_model.RoutingReplay` in megatron-core's top-k routing
(`moe_utils.topk_routing_with_score_function`, the settings `megatron_convert.moe_config` gives)
against transformers' `Qwen2MoeTopKRouter` replayed by agentrl/moe.py: the same experts and gate
weights, a row holding -1 keeping the router's own choice, and the router logits' gradient. The
models themselves are compared in tests/integration/test_megatron_moe.py."""

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'agentrl[megatron]')"
)

from agentrl.learner.megatron_model import RoutingReplay
from agentrl.moe import replay_routing


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_megatron_routing_equals_the_replayed_hf_router(norm_topk_prob):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    router = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=2,
                                               norm_topk_prob=norm_topk_prob))  # fmt: skip
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(5, 16)
    recorded = torch.stack([torch.randperm(6)[:2] for _ in range(5)]).int()
    recorded[3] = -1  # nothing recorded: the router's own choice
    with torch.no_grad(), replay_routing(router, recorded[:, None, :]):
        _, hf_weights, hf_index = router(x)
    own = router(x)[2]

    logits = (x @ router.weight.detach().t()).requires_grad_(True)
    replay = RoutingReplay()
    for target in (None, recorded):
        replay.target = target
        probs, routing_map = topk_routing_with_score_function(
            logits, 2, use_pre_softmax=not norm_topk_prob, score_function="softmax", router_replay=replay
        )
        chosen = routing_map.nonzero()[:, 1].view(5, 2)
        expected = hf_index if target is not None else own
        assert torch.equal(chosen, expected.sort(-1).values)
    torch.testing.assert_close(probs.gather(1, hf_index), hf_weights, rtol=0, atol=1e-6)
    assert torch.equal(chosen[3], own[3].sort().values) and not torch.equal(hf_index, own)
    (probs * torch.randn_like(probs)).sum().backward()
    assert logits.grad.abs().sum() > 0  # the gate weights come from the router's logits: it trains


def test_replay_refuses_routing_of_another_shape():
    replay = RoutingReplay()
    replay.target = torch.zeros(4, 2, dtype=torch.int)
    with pytest.raises(
        ValueError, match=r"routes \(5, 2\) tokens × top-k, the recorded experts are \(4, 2\)"
    ):
        replay.get_replay_topk(torch.randn(5, 6), 2, None, None, lambda s, k, *_: torch.topk(s, k, dim=1))
