"""Which verdict rule tells dtype noise from bugs? Correct and deliberately broken bf16 ports
of four architectures, each layer judged by five rules.

    PJRT_DEVICE=CPU python bench/bench_verdicts.py [--target xla] [--layers 4]

Correct ports: every layer of each model on the target (torch-xla by default) against bf16
goldens made on the CPU. Bugs: planted in one layer through the same hook a user's port
uses, on the target. Rules: the seeds' fixed table, torch.testing.assert_close's bf16
defaults, the published R <= 1.2 rule (tensor-wide noise ratio), cosine > 0.99 alone, and
this plugin's default verdict (noise policy).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fixtures"))

import torch

from pytest_layerparity.compare.floor import FLOOR_KEY, floor_stats
from pytest_layerparity.options import make_settings
from pytest_layerparity.session import LayerParitySession
from pytest_layerparity.store.callspec import primary_output_name

settings = make_settings


# -- bugs, planted through the target-build hook ---------------------------------------------


def wrong_norm_eps(layer, config):
    norm = layer.input_layernorm
    norm.variance_epsilon = 1e-2
    return layer


class _SwappedRotary(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        cos, sin = position_embeddings
        return self.layer(hidden_states, position_embeddings=(cos, -sin), **kwargs)


def rotary_halves_swapped(layer, config):
    return _SwappedRotary(layer)


def head_dropped(layer, config):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def drop(module, args):
        x = args[0].clone()
        x[..., head_dim * 1 : head_dim * 2] = 0
        return (x, *tuple(args[1:]))

    layer.self_attn.o_proj.register_forward_pre_hook(drop)
    return layer


def expert_scaling(layer, config):
    experts = layer.mlp.experts
    experts.register_forward_hook(lambda module, args, output: output * 1.05)
    return layer


def softmax_router(layer, config):
    gate = layer.mlp.gate
    original = gate.forward

    def forward(hidden_states, e_score_correction_bias):
        hidden = hidden_states.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden.to(gate.weight.dtype), gate.weight)
        weights = torch.softmax(logits.float(), dim=-1)
        choice = weights + e_score_correction_bias
        _, index = torch.topk(choice, gate.top_k, dim=-1, sorted=False)
        top = weights.gather(1, index)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, index

    gate.forward = forward
    del original
    return layer


BUGS = {
    "wrong norm epsilon": (wrong_norm_eps, None),
    "rotary halves swapped": (rotary_halves_swapped, None),
    "one head's output dropped": (head_dropped, None),
    "wrong expert scaling": (expert_scaling, ("qwen3_moe", "mixtral", "minimax_m2")),
    "softmax router (model uses sigmoid)": (softmax_router, ("minimax_m2",)),
}


# -- rules --------------------------------------------------------------------------------------


def judge(outcome, golden, target, reference) -> dict[str, bool]:
    m = outcome.metrics
    table = (
        m.max_abs_diff <= 0.01
        and m.mean_abs_diff <= 0.001
        and m.similarity_percentage >= 95
        and m.cosine_similarity >= 0.99
        and m.pearson_correlation >= 0.99
    )
    close = bool(torch.isclose(target.float(), golden.float(), rtol=1.6e-2, atol=1e-5).all())
    r_rule = floor_stats(golden, target, reference).noise_ratio <= 1.2
    return {
        "seeds' table": table,
        "assert_close": close,
        "R <= 1.2": r_rule,
        "cosine > 0.99": m.cosine_similarity > 0.99,
        "default verdict": outcome.passed,
    }


def run_layer(session, index):
    entry = session.load_golden(index)
    run = session.run_layer(session.build_target(index), entry)
    outcome = session.compare_entry(index, entry, run)
    golden = entry.tensors[primary_output_name(entry.metadata["call"])]
    return outcome, golden, run.output.detach().cpu(), entry.tensors[FLOOR_KEY]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="xla")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    from tiny_models import ARCHITECTURES, make

    work = Path(tempfile.mkdtemp(prefix="verdicts-"))
    rules = ["seeds' table", "assert_close", "R <= 1.2", "cosine > 0.99", "default verdict"]
    false_fail = dict.fromkeys(rules, 0)
    caught = dict.fromkeys(rules, 0)
    correct_total = bug_total = 0
    bug_rows = []
    started = time.time()
    for kind in ARCHITECTURES:
        model = make(kind, work / kind, num_layers=args.layers)
        store = work / f"{kind}-golden"
        extract = LayerParitySession(
            settings(
                gpu_golden=True,
                extract=True,
                model=str(model),
                golden_dir=str(store),
                dtype="bfloat16",
                seq_len=args.seq_len,
            ),
            ROOT,
        )
        for i in range(args.layers):
            extract.extract_layer(i)
        correct = LayerParitySession(settings(target=args.target, model=str(model), golden_dir=str(store)), ROOT)
        for i in range(args.layers):
            outcome, g, t, r = run_layer(correct, i)
            verdicts = judge(outcome, g, t, r)
            correct_total += 1
            for rule in rules:
                false_fail[rule] += not verdicts[rule]
            print(
                f"{kind:<11} layer {i} correct   noise_ratio {outcome.noise.noise_ratio:7.3f} token "
                f"{outcome.noise.token_noise_ratio:7.3f} "
                f"max_abs {outcome.metrics.max_abs_diff:.4f} z {outcome.noise.contribution_z:7.2f} zg "
                f"{outcome.noise.golden_contribution_z:7.2f} "
                + " ".join(f"{r}={'pass' if v else 'FAIL'}" for r, v in verdicts.items()),
                flush=True,
            )
        correct.teardown()
        for bug, (plant, kinds) in BUGS.items():
            if kinds and kind not in kinds:
                continue
            layer_of_bug = args.layers // 2

            def hook(layer_idx, reference_layer, model_config, device, plant=plant, at=layer_of_bug):
                if layer_idx == at:
                    reference_layer = plant(reference_layer, model_config)
                return reference_layer.to(device)

            broken = LayerParitySession(
                settings(target=args.target, model=str(model), golden_dir=str(store)), ROOT, hook
            )
            outcome, g, t, r = run_layer(broken, layer_of_bug)
            verdicts = judge(outcome, g, t, r)
            bug_total += 1
            for rule in rules:
                caught[rule] += not verdicts[rule]
            bug_rows.append((kind, bug, verdicts))
            print(
                f"{kind:<11} layer {layer_of_bug} {bug:<36} noise_ratio {outcome.noise.noise_ratio:9.3f} token "
                f"{outcome.noise.token_noise_ratio:9.3f} z {outcome.noise.contribution_z:8.2f} zg "
                f"{outcome.noise.golden_contribution_z:7.2f} "
                + " ".join(f"{r}={'pass' if v else 'FAIL'}" for r, v in verdicts.items()),
                flush=True,
            )
            broken.teardown()
    print(
        f"\n{correct_total} correct layers and {bug_total} planted bugs, bf16, target {args.target}, "
        f"{args.layers} layers per model, {time.time() - started:.0f} s"
    )
    print(f"{'rule':<18} {'false failures':>16} {'bugs caught':>12}")
    for rule in rules:
        print(f"{rule:<18} {false_fail[rule]:>10} of {correct_total:<3} {caught[rule]:>6} of {bug_total}")
    print("\nper bug (caught = FAIL):")
    for kind, bug, verdicts in bug_rows:
        print(
            f"  {kind:<11} {bug:<36} " + " ".join(f"{r}={'caught' if not v else 'missed'}" for r, v in verdicts.items())
        )


if __name__ == "__main__":
    main()
