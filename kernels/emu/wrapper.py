"""Generate the C++ translation unit that turns one .cu source into an emulated module.

The source is pasted in unchanged; after it come the definitions of its dynamic shared
memory arrays (CUDA sizes them at launch, C++ needs a size at compile time) and a table with
one entry per kernel, found through the same name expressions CuPy's RawModule takes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# sm_90's opt-in maximum; launches ask for less and only that much is poisoned per block.
DYNAMIC_SMEM_CAPACITY = 227 * 1024

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_ALIGN = r"(?:(?:__align__|alignas)\s*\(\s*\d+\s*\)\s*)*"
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+"
    + _ALIGN
    + r"([A-Za-z_][\w:\s]*?)\s+"
    + _ALIGN
    + r"([A-Za-z_]\w*)\s*\[\s*\]"
)
_EXTERN_C_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\("
)


@dataclass(frozen=True)
class DynamicShared:
    type_name: str
    name: str


def strip_comments(code: str) -> str:
    return _COMMENTS.sub(" ", code)


def dynamic_shared_arrays(code: str) -> list[DynamicShared]:
    found: dict[str, DynamicShared] = {}
    for m in _EXTERN_SHARED.finditer(strip_comments(code)):
        decl = DynamicShared(" ".join(m.group(1).split()), m.group(2))
        prev = found.setdefault(decl.name, decl)
        if prev.type_name != decl.type_name:
            raise ValueError(f"extern __shared__ {decl.name} declared with two types")
    return list(found.values())


def extern_c_kernels(code: str) -> list[str]:
    return sorted(set(_EXTERN_C_KERNEL.findall(strip_comments(code))))


def kernel_param_names(code: str, name: str) -> list[str]:
    """Parameter names of the kernel `name` (a name expression such as `k<float, 64>` or an
    extern "C" name), for memory-check reports; [] when the declaration is not found."""
    base = re.escape(name.split("<")[0].strip())
    text = strip_comments(code)
    m = re.search(r"__global__[^;{}]*?\b" + base + r"\s*\(", text)
    if m is None:
        return []
    depth, i, start = 1, m.end(), m.end()
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    params, depth, cur = [], 0, ""
    for ch in text[start : i - 1]:
        depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            params.append(cur)
            cur = ""
        else:
            cur += ch
    params.append(cur)
    names = [re.findall(r"[A-Za-z_]\w*", p) for p in params if p.strip()]
    return [n[-1] if n else "" for n in names]


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def generate(code: str, kernel_names: Sequence[str], source_name: str = "kernel.cu") -> str:
    if not kernel_names:
        raise ValueError("an emulated module needs at least one kernel")
    lines = [f"#line 1 {_c_string(source_name)}", code, "", '#line 1 "cudaemu-wrapper"']
    lines.append('#include "cudaemu/module.h"')
    arrays = dynamic_shared_arrays(code)
    for a in arrays:
        lines.append(
            f"thread_local __attribute__((aligned(CUDAEMU_SHARED_ALIGN))) {a.type_name} "
            f"{a.name}[{DYNAMIC_SMEM_CAPACITY} / sizeof({a.type_name})];"
        )
    lines.append("static int cudaemu_dynamic_smem(::cudaemu::Span* out, int max) {")
    lines.append("  int n = 0;")
    for a in arrays:
        lines.append(
            f"  if (n < max) out[n++] = ::cudaemu::Span{{reinterpret_cast<char*>({a.name}), "
            f"sizeof({a.name})}};"
        )
    lines.append("  return n;")
    lines.append("}")
    lines.append("static const ::cudaemu::KernelEntry cudaemu_table[] = {")
    lines.extend(f"    CUDAEMU_KERNEL({_c_string(n)}, {n})," for n in kernel_names)
    lines.append("};")
    lines.append(f"CUDAEMU_MODULE(cudaemu_table, &cudaemu_dynamic_smem, {DYNAMIC_SMEM_CAPACITY})")
    return "\n".join(lines) + "\n"
