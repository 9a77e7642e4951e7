"""The layering, read from the source: no module of qerl imports one of a higher layer, none imports the tools built
on it (eval, benchmarks, experiments); each tool folder imports only the folders it is built on (TOOL_BASES: experiments
may import benchmarks and eval, never the reverse); no module anywhere imports in a cycle. Lazy imports inside
functions count too: they are how a cycle hides. A new module of qerl must be given its layer here."""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

from benchmarks.launch import REPO

TOOLS = ("eval", "benchmarks", "experiments")
# Each tool folder and what it may import besides itself; benchmarks/probes (kernel development) apart from what a
# user runs in benchmarks/.
TOOL_BASES = {
    "eval": {"qerl"},
    "benchmarks": {"qerl"},
    "benchmarks.probes": {"qerl", "benchmarks"},
    "experiments": {"qerl", "eval", "benchmarks", "benchmarks.probes"},
}

# Lowest first; a module may import its own layer and those below it (patterns: fnmatch on the dotted name).
LAYERS = [
    ["qerl", "qerl.errors", "qerl.device_facts", "qerl.plotting"],  # facts and one-line errors
    ["qerl.cli", "qerl.sniff", "qerl.dependent_launch", "qerl.master_port"],  # command line, sniffing, launch facts
    ["qerl.field_rules", "qerl.config"],  # what each setting accepts; the training config
    ["qerl.nvfp4", "qerl.nvfp4.*"],  # the format, its kernels, checkpoints
    [
        "qerl.input_checks",
        "qerl.models",
        "qerl.models.*",
        "qerl.tiny",
        "qerl.sharding",
        "qerl.norms",
        "qerl.unpadded_forward",
        "qerl.micro_batches",
        "qerl.importance_correction",
        "qerl.rewards",
        "qerl.nonfinite_dump",
        "qerl.dense_weights",
        "qerl.kept_activations",
    ],
    ["qerl.aqn", "qerl.base_model", "qerl.lora", "qerl.data", "qerl.rollout", "qerl.rollout.*", "qerl.quantize"],
    ["qerl.callbacks", "qerl.truncation", "qerl.recipes", "qerl.rounds_ahead"],
    ["qerl.trainer", "qerl.trainer_rollouts", "qerl.run_dir"],
    ["qerl.train", "qerl.demo", "qerl.rollout_server"],
]


def modules() -> dict[str, Path]:
    found = {}
    for path in (p for root in ("qerl", *TOOLS) for p in (REPO / root).rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules `name` imports anywhere in its file: repository modules by dotted name (`from pkg import sub` is
    an import of pkg.sub, not of pkg's other names' module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    result = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            result.add(target)
    return result


def layer_of(name: str) -> int:
    for level, patterns in enumerate(LAYERS):
        if any(fnmatch(name, pattern) for pattern in patterns):
            return level
    raise AssertionError(f"{name}: give it a layer in tests/test_layers.py's LAYERS")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def folder(name: str) -> str:
    """The folder a module belongs to for TOOL_BASES: its top-level package, or benchmarks.probes."""
    return "benchmarks.probes" if name.startswith("benchmarks.probes") else name.split(".")[0]


def test_no_module_imports_a_higher_layer_or_a_tool():
    upward = []
    for name, targets in graph().items():
        if not name.startswith("qerl"):
            continue
        for target in targets:
            if target.split(".")[0] in TOOLS:
                upward.append(f"{name} -> {target} (a tool built on qerl)")
            elif target.startswith("qerl") and layer_of(target) > layer_of(name):
                upward.append(f"{name} (layer {layer_of(name)}) -> {target} (layer {layer_of(target)})")
    assert not upward, "\n".join(sorted(upward))


def test_each_tool_imports_only_what_it_is_built_on():
    stray = [
        f"{name} -> {target}"
        for name, targets in graph().items()
        if not name.startswith("qerl")
        for target in targets
        if folder(target) != folder(name) and folder(target) not in TOOL_BASES[folder(name)]
    ]
    assert not stray, "\n".join(sorted(stray))


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := walk(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := walk(node)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_walk_finds_what_it_must():
    """The checks above see lazy, relative and package imports (so that a pass means something)."""
    g = graph()
    assert "qerl.rollout.native.engine" in g["qerl.rollout.native"]  # lazy, inside a method
    assert "qerl.rollout.native.kv_cache" in g["qerl.rollout.native.engine"]  # `from pkg import submodule`
    assert "qerl.errors" in g["qerl.cli"]
    assert "qerl.trainer" in g["qerl.train"]
    assert "eval.generate" in g["experiments.arms"]  # lazy, in a tool
    assert "benchmarks.launch" in g["experiments.multi_gpu_runner"]  # `from benchmarks import launch`


# The engines' classes: a tool builds an engine through qerl.rollout (create_backend / build_backend on a
# RolloutSetup), never by naming one. Kernel-development probes time the engines' insides and may.
ENGINE_CLASSES = ("NativeRollout", "VLLMRollout", "TransformersRollout", "NativeEngine", "VLLMEngine", "Decoder")


def test_tools_build_engines_only_through_qerl_rollout():
    named = []
    for name, path in modules().items():
        if name.startswith("qerl") or folder(name) == "benchmarks.probes":
            continue
        tree = ast.parse(path.read_text())
        calls = {
            node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        calls |= {
            node.func.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        named += [f"{name} builds {cls}" for cls in ENGINE_CLASSES if cls in calls]
    assert not named, "\n".join(named)


def test_only_trls_trainer_wraps_a_model_with_peft_inside_qerl():
    """QeRLTrainer is the package's one road from a base to a trainable policy: it hands lora.lora_config to TRL, whose
    trainer wraps the model; no module of qerl calls peft's get_peft_model itself but a rollout server's native
    engine, whose frozen copy of the trainer's adapter takes the settings the trainer sends."""
    wrapping = [
        name
        for name, path in modules().items()
        if name.startswith("qerl")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "get_peft_model"
    ]
    assert wrapping == ["qerl.rollout.native.server_engine"], wrapping
