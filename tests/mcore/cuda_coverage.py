"""The CPU backend's redirect table checked against megatron-core's source.

A static ``ast`` scan (nothing is imported) of the megatron-core modules the CPU backend's
supported features run, for CUDA uses: ``torch.cuda.*``, ``from torch.cuda import``, ``"cuda"``
literals, ``.is_cuda``, ``.cuda()``, CUDA tensor type names. Each use must be accounted for by
:data:`.cpu_backend.REDIRECTS` (or the backend's device mode) or by :data:`NOT_REDIRECTED` here.
The pin test asserts :func:`uncovered_cuda_uses` is empty, so a megatron-core upgrade that adds a
CUDA path fails it instead of failing a CPU run in the middle.

Public API
----------
``CPU_PATH_MODULES``
    The megatron-core modules the supported features execute (the pin test scans them).
``NOT_REDIRECTED``
    CUDA uses in ``CPU_PATH_MODULES`` that are deliberately left alone, each with the reason
    (off the supported path, or harmless on CPU).
``CudaUse``, ``cuda_uses(module)``, ``is_covered(use)``, ``uncovered_cuda_uses()``
    One use found, the scan of one module, whether the tables cover a use, and the uses neither
    table covers.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass

from megatron_hetero.mcore.cpu_backend import REDIRECTS, SAFE_CUDA_QUERIES

__all__ = ["CPU_PATH_MODULES", "NOT_REDIRECTED", "CudaUse", "cuda_uses", "is_covered",
           "uncovered_cuda_uses"]

#: megatron-core modules that the supported features run (relative to ``megatron.core``);
#: the pin test scans their source for CUDA uses and checks that each is covered.
CPU_PATH_MODULES: tuple[str, ...] = (
    "parallel_state",
    "utils",
    "pipeline_parallel.schedules",
    "pipeline_parallel.p2p_communication",
    "pipeline_parallel.utils",  # the interleaved schedule's virtual-stage helpers
    "transformer.pipeline_parallel_layer_layout",  # the layout parser (virtual stages too)
    "distributed.distributed_data_parallel",
    "distributed.param_and_grad_buffer",
    "distributed.finalize_model_grads",
    "optimizer",
    "optimizer.optimizer",
    "optimizer.clip_grads",
    "optimizer.distrib_optimizer",
    "tensor_parallel.random",
    "tensor_parallel.layers",
    "tensor_parallel.mappings",
    "tensor_parallel.utils",
    "tensor_parallel.cross_entropy",
    "transformer.transformer_block",
    "transformer.transformer_layer",
    "transformer.attention",
    "transformer.dot_product_attention",
    "transformer.mlp",
    "transformer.module",
    "models.gpt.gpt_model",
    "models.common.language_module.language_module",
    "models.common.embeddings.language_model_embedding",
    "models.common.embeddings.rotary_pos_embedding",
    "optimizer.cpu_offloading.hybrid_optimizer",  # a plan's offload.optimizer_fraction
    "pipeline_parallel.fine_grained_activation_offload",  # a plan's offload.module_inputs
    # mixture of experts: the layer, its router, the all-to-all and all-gather token
    # dispatchers and the sequential experts (tests/mcore/test_moe_cpu.py)
    "transformer.moe.moe_layer",
    "transformer.moe.router",
    "transformer.moe.token_dispatcher",
    "transformer.moe.experts",
    "transformer.moe.moe_utils",
    "transformer.moe.shared_experts",
)

#: ``(module under megatron.core, use, reason)``: CUDA uses in CPU_PATH_MODULES that the
#: backend leaves alone. ``use`` is what :func:`cuda_uses` reports.
NOT_REDIRECTED: tuple[tuple[str, str, str], ...] = (
    ("utils", "torch.cuda.temperature", "StragglerDetector (off the path; raiser if reached)"),
    ("utils", "torch.cuda.power_draw", "StragglerDetector (off the path; raiser if reached)"),
    ("utils", "torch.cuda.utilization", "StragglerDetector (off the path; raiser if reached)"),
    ("utils", "torch.cuda.clock_rate", "StragglerDetector (off the path; raiser if reached)"),
    ("pipeline_parallel.schedules", "torch.autocast('cuda')", "CUDA autocast leaves CPU "
     "tensors alone (and is only entered with fp8/fp4 settings)"),
    ("optimizer.optimizer", ".is_cuda", "optimizer state offload/reload (off the path)"),
    ("tensor_parallel.random", "torch.cuda.CUDAGraph", "cudagraph-safe RNG only (off the path)"),
    ("tensor_parallel.random", "from torch.cuda import _lazy_call",
     "used only by _set_cuda_rng_state, which is redirected"),
    ("tensor_parallel.random", "from torch.cuda import _lazy_init",
     "used only by _set_cuda_rng_state, which is redirected"),
    ("tensor_parallel.random", "from torch.cuda import device",
     "used only by _set_cuda_rng_state, which is redirected"),
    ("tensor_parallel.layers", "torch.cuda.amp.custom_fwd", "torch < 2.4 only; torch.amp's "
     "custom_fwd(device_type='cuda') is a no-op for CPU autocast"),
    ("tensor_parallel.layers", "torch.cuda.amp.custom_bwd", "torch < 2.4 only"),
    ("tensor_parallel.layers", "device_type='cuda'", "partial(torch.amp.custom_fwd/custom_bwd, "
     "device_type='cuda'): no CUDA autocast is active on CPU, so a pass-through"),
    ("optimizer.cpu_offloading.hybrid_optimizer", ".is_cuda", "the split of device and host "
     "parameters: megatron_hetero.mcore.cpu_offload makes the optimizer's own parameters "
     "count as device parameters while it splits (CPU ranks)"),
    ("pipeline_parallel.fine_grained_activation_offload", "default 'cuda'", "GPUTensorPool's "
     "default device; megatron-core builds it only as the host pool (device='cpu')"),
    ("pipeline_parallel.utils", "torch.cuda.Stream.priority_range", "set_streams (megatron-core "
     "0.19): only the combined 1F1B of expert-parallel overlap calls it (off the path)"),
    ("pipeline_parallel.fine_grained_activation_offload", "'cuda' in Compare", "ChunkOffloadHandler."
     "_can_manage_tensor_for_offload (megatron-core 0.19) manages cuda tensors only: "
     "megatron_hetero.mcore.cpu_offload wraps it so that a CPU rank's tensor is asked about as "
     "its device's"),
    ("transformer.moe.token_dispatcher", "torch.cuda.get_device_capability", "the NCCL "
     "expert-parallel manager of the 'flex' dispatcher (megatron-core 0.19; needs NCCL's device "
     "API, off the path: plans use the all-to-all and all-gather dispatchers)"),
    ("transformer.mlp", "torch.cuda.OutOfMemoryError", "an exception class in an except clause"),
    ("transformer.module", "torch.cuda.FloatTensor", "fp16/bf16 conversion helpers (fp32 runs "
     "do not convert)"),
    ("transformer.module", "torch.cuda.HalfTensor", "fp16/bf16 conversion helpers"),
    ("transformer.module", "torch.cuda.BFloat16Tensor", "fp16/bf16 conversion helpers"),
)


@dataclass(frozen=True, slots=True)
class CudaUse:
    """One CUDA use in megatron-core's source."""

    module: str
    """Module under ``megatron.core``."""
    line: int
    use: str
    """``torch.cuda.X[.Y]``, ``from torch.cuda import X``, ``device='cuda'`` and the like."""
    function: str
    """Qualified name of the outermost enclosing function ('' at module level)."""


_DEVICE_LITERAL_OK = "device literal"  # contexts the device mode maps to the CPU
_TYPE_NAMES = {"torch.cuda.FloatTensor", "torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"}


def _chain(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def cuda_uses(module: str, source: str | None = None) -> list[CudaUse]:
    """Scan ``megatron.core.<module>``'s source (not importing it; or ``source`` when given)
    for CUDA uses."""
    if source is None:
        spec = importlib.util.find_spec(f"megatron.core.{module}")
        if spec is None or not spec.origin:
            raise ModuleNotFoundError(f"megatron.core.{module}")
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
    tree = ast.parse(source)
    uses: list[CudaUse] = []

    def visit(node, parent, function, prefix=""):
        if isinstance(node, ast.ClassDef) and not function:
            prefix = f"{prefix}{node.name}."
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not function:
            function = prefix + node.name  # the outermost def: nested helpers belong to it
        use = None
        if isinstance(node, ast.Attribute) and not isinstance(parent, ast.Attribute):
            chain = _chain(node)
            if chain and chain.startswith("torch.cuda."):
                use = chain
            elif node.attr == "is_cuda":
                use = ".is_cuda"
            elif node.attr == "cuda" and isinstance(parent, ast.Call) and parent.func is node:
                use = "Tensor.cuda"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
            for alias in node.names:
                uses.append(CudaUse(module, node.lineno, f"from {node.module} import {alias.name}",
                                    function))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value == "cuda" or node.value.startswith("cuda:")):
            use = _literal_context(node, parent)
        elif isinstance(node, ast.Constant) and node.value in _TYPE_NAMES:
            use = "Tensor.type"
        if use is not None:
            uses.append(CudaUse(module, node.lineno, use, function))
        for child in ast.iter_child_nodes(node):
            visit(child, node, function, prefix)

    visit(tree, None, "")
    return uses


def _literal_context(node, parent) -> str:
    if isinstance(parent, ast.keyword):
        if parent.arg == "device":
            return _DEVICE_LITERAL_OK
        return f"{parent.arg}='cuda'"
    if isinstance(parent, ast.Call):
        func = _chain(parent.func) or ""
        if func == "torch.device" or func.endswith(".to"):
            return _DEVICE_LITERAL_OK
        return f"{func}('cuda')"
    if isinstance(parent, ast.arguments):
        return "default 'cuda'"
    return f"'cuda' in {type(parent).__name__}"


def is_covered(use: CudaUse) -> bool:
    """Whether REDIRECTS (or the device mode) or NOT_REDIRECTED accounts for ``use``."""
    full = f"megatron.core.{use.module}"
    if (full, use.function) in {(m, a) for m, a, _ in REDIRECTS}:
        return True  # inside a function the backend replaces
    if use.use in (_DEVICE_LITERAL_OK, "Tensor.type", "Tensor.cuda"):
        return True  # the device mode
    if use.use.startswith("torch.cuda."):
        rest = use.use[len("torch.cuda."):]
        head = rest.split(".")[0]
        if head in SAFE_CUDA_QUERIES or ("torch.cuda", rest) in {(m, a) for m, a, _ in REDIRECTS}:
            return True
        sub, _, attr = rest.rpartition(".")
        if sub and (f"torch.cuda.{sub}", attr) in {(m, a) for m, a, _ in REDIRECTS}:
            return True
    return (use.module, use.use) in {(m, u) for m, u, _ in NOT_REDIRECTED}


def uncovered_cuda_uses(modules=CPU_PATH_MODULES) -> list[CudaUse]:
    """CUDA uses in ``modules`` that neither REDIRECTS nor NOT_REDIRECTED covers."""
    return [u for m in modules for u in cuda_uses(m) if not is_covered(u)]
