"""The options of what a run chooses: its mode, target and port, the model, the layers and the
golden input."""

from __future__ import annotations

from .declaration import Option
from .parsers import DTYPES, GOLDEN_DEVICES_HELP, dtype_choice, golden_device, non_negative_int, positive_int

CHOICE_OPTIONS = (
    Option(
        "gpu_golden",
        "--gpu-golden",
        "Run the reference model (CUDA when visible, else CPU). With --extract, write goldens; without, check the "
        "stored goldens reproduce.",
        action="store_true",
        default=False,
    ),
    Option(
        "extract",
        "--extract",
        "With --gpu-golden: write golden references for the selected layers.",
        action="store_true",
        default=False,
    ),
    Option(
        "golden_device",
        "--golden-device",
        f"Device of the reference run: {GOLDEN_DEVICES_HELP}. Default: auto.",
        type=golden_device,
        default="auto",
        ini=True,
        metavar="DEVICE",
    ),
    Option(
        "xla",
        "--xla",
        "Run each layer on the torch-xla device (same as --target xla).",
        action="store_true",
        default=False,
    ),
    Option(
        "neuron",
        "--neuron",
        "Test NxDI's port of the architecture compiled for NeuronCores (same as --port nxdi --target neuron; "
        "with a conftest's pytest_layerparity_build_target_layer, or --port hf, its port runs eagerly on the "
        "NeuronCore through torch-neuronx).",
        action="store_true",
        default=False,
    ),
    Option(
        "target",
        "--target",
        "Device to test the port on. Default: none (no parity tests).",
        choices=("cpu", "cuda", "xla", "neuron"),
        default=None,
    ),
    Option(
        "port",
        "--port",
        "Whose implementation of each layer is under test: hf (the model's own HuggingFace layer, or the port a "
        "conftest's build hook returns) or nxdi (the neuronx-distributed-inference port of the architecture, built "
        "as NxDI builds it: with --target cpu eagerly in NxD's CPU mode, with --target neuron compiled through NxDI's "
        "build_module). Default: nxdi with --neuron (or --target neuron), unless a conftest implements "
        "pytest_layerparity_build_target_layer (then hf: the conftest's own port); hf otherwise.",
        choices=("hf", "nxdi"),
        default=None,
        ini=True,
    ),
    Option(
        "nxdi_app",
        "--nxdi-app",
        "With --port nxdi: the NxDI application class of a port outside NxDI's tree (package.module:Class, e.g. a "
        "contributed model's NeuronMiniMaxM2ForCausalLM). Default: NxDI's class for the model_type.",
        default=None,
        ini=True,
        cli=False,
        metavar="MODULE:CLASS",
    ),
    Option(
        "model",
        "--model",
        "HuggingFace model folder (config.json + safetensors). Default: ini layerparity_model.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "golden_dir",
        "--golden-dir",
        "Golden store folder. Default: ini layerparity_golden_dir, else layerparity-goldens/<model folder name>.",
        default=None,
        ini=True,
        metavar="DIR",
    ),
    Option(
        "layers",
        "--layers",
        "Layers to test: 17, 0-30, 0-5,10,20-25 or all. Default: all.",
        default="all",
        ini=True,
        metavar="SPEC",
    ),
    Option(
        "layer_ranges",
        "--layer-ranges",
        "Also test ranges run end to end from the golden input of their first layer, e.g. 0-5,6-11. Default: none.",
        default=None,
        metavar="SPEC",
    ),
    Option(
        "layer_module",
        "--layer-module",
        "Dotted path of the layer list when it is not found automatically (e.g. encoder.layer). Default: found "
        "automatically.",
        default=None,
        ini=True,
        cli=False,
        metavar="PATH",
    ),
    Option(
        "seq_len",
        "--seq-len",
        "Tokens per sequence of the golden input. Default: 32.",
        type=positive_int,
        default=32,
        ini=True,
        metavar="N",
    ),
    Option(
        "decode_steps",
        "--decode-steps",
        "Extraction: after the prompt, run N greedy decode steps (one token each, with the KV cache) and store "
        "every selected layer's call in each step, for the decode-step tests. 0: prompt only. Default: 2.",
        type=non_negative_int,
        default=2,
        ini=True,
        metavar="N",
    ),
    Option(
        "logits_topk",
        "--logits-topk",
        "Extraction: keep the model's next-token logits at every prompt and decode position as the top-K ids and "
        "logits plus the log-sum-exp, with their noise envelope, for test_model_parity (whole model, not under "
        "--device-map stream). 0: no whole-model golden. Default: 16.",
        type=non_negative_int,
        default=16,
        ini=True,
        cli=False,
        metavar="K",
    ),
    Option(
        "batch_size",
        "--batch-size",
        "Sequences in the golden input. Default: 1.",
        type=positive_int,
        default=1,
        ini=True,
        metavar="N",
    ),
    Option(
        "seed",
        "--seed",
        "Seed of the golden input token ids. Default: 0.",
        type=non_negative_int,
        default=0,
        ini=True,
        cli=False,
        metavar="N",
    ),
    Option(
        "prompt",
        "--prompt",
        "Use this text through the model's tokenizer as the golden input instead of random token ids. Default: none.",
        default=None,
        metavar="TEXT",
    ),
    Option(
        "dtype",
        "--dtype",
        f"Dtype of the reference run and the port: {', '.join(DTYPES)}. Default: the checkpoint's own (dtype or "
        "torch_dtype in config.json, as transformers' 'auto' reads it; float32 when it names none); the stored "
        "golden's dtype when testing.",
        type=dtype_choice,
        default=None,
        ini=True,
    ),
)
