"""Reading optimised HLO text: the matmul FLOPs and collective bytes of one executed step (every loop iteration
counted), and what XLA's own rematerialisation added. Used by tools/compile_for (reports for TPU / GPU targets)
and by train.py (the FLOPs per device behind the logged TFLOP/s and MFU)."""
from __future__ import annotations

import functools
import math
import re

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8}


def _array_bytes(type_str: str) -> int:
  """Total bytes of the arrays in an HLO type string ('bf16[8,128]{1,0}', a tuple of them, or operand lists)."""
  return sum(_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", type_str))


_CONST = re.compile(r"\s*%([\w.\-]+)\s*=\s*[su]\d+\[\][^=]*constant\((-?\d+)\)")


def _operands(line: str, op: str) -> list:
  """The operand names of `op(...)` in an instruction line (TPU prints /*index=N*/ comments among them)."""
  args = re.sub(r"/\*[^*]*\*/", "", line.split(f" {op}(", 1)[1])
  return re.findall(r"%([\w.\-]+)", args.split(")", 1)[0]) if not args.startswith(")") else []


def _trip_count(while_line: str, comps: dict, defs: dict) -> int:
  """Iterations of a while loop: XLA's known_trip_count where the backend prints it (GPU, CPU); otherwise (TPU's
  optimised HLO drops it) read from the loop: its condition `counter < bound`, the body's `counter + step` and the
  counter's initial value, constants each (JAX's scan / fori_loop count 0, 1, ...; the partitioner's windowed
  matmul loops step by 2). 1 when the bound is not found. defs: instruction name -> line, over the module."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_line)
  if known:
    return int(known.group(1))
  cond = re.search(r"\bcondition=%?([\w.\-]+)", while_line)
  body = re.search(r"\bbody=%?([\w.\-]+)", while_line)
  lines = comps.get(cond.group(1), []) if cond else []
  consts = {m.group(1): int(m.group(2)) for m in map(_CONST.match, lines) if m}
  for line in lines:
    root = re.search(r"ROOT\s.*compare\(%([\w.\-]+),\s*%([\w.\-]+)\),\s*direction=LT", line)
    if not (root and root.group(2) in consts):
      continue
    bound, init, step = consts[root.group(2)], 0, 1
    index = next((re.search(r"index=(\d+)", x) for x in lines
                  if re.match(rf"\s*%{re.escape(root.group(1))}\s*=.*get-tuple-element\(", x)), None)
    if index is not None:
      k = int(index.group(1))
      result = next((x for x in comps.get(body.group(1), []) if x.lstrip().startswith("ROOT")), "") if body else ""
      ops = _operands(result, "tuple") if " tuple(" in result else []
      update = defs.get(ops[k], "") if k < len(ops) else ""
      if " add(" in update:
        steps = [int(m.group(2)) for m in (_CONST.match(defs.get(o, "")) for o in _operands(update, "add")) if m]
        step = steps[0] if steps and steps[0] > 0 else 1
      start = _operands(while_line, "while")
      start = defs.get(start[0], "") if start else ""
      start = _operands(start, "tuple") if " tuple(" in start else []
      value = defs.get(start[k], "") if k < len(start) else ""
      while " copy(" in value:  # the initial counter, copied into place
        value = defs.get((_operands(value, "copy") or [""])[0], "")
      m = _CONST.match(value)
      init = int(m.group(2)) if m else 0
    return max(0, -(-(bound - init) // step))
  return 1


@functools.lru_cache(maxsize=2)  # matmul_flops, collective_stats and compiler_remat read the same program
def _computations(hlo: str):
  """Optimised HLO text -> ({computation: [instruction lines]}, times(computation) -> executions per step): an
  instruction inside a loop body runs once per iteration (XLA's known_trip_count), nested loops multiply, fused and
  called computations run as often as their caller."""
  comps, current, entry = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      current = head.group(2)
      comps[current] = []
      if head.group(1):
        entry = current
    elif current is not None and line.strip() and line.strip() != "}":
      comps[current].append(line)
  defs = {m.group(1): line for lines in comps.values() for line in lines
          for m in [re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=", line)] if m}
  calls = {name: [] for name in comps}  # callee -> [(caller, factor)]
  for name, lines in comps.items():
    for line in lines:
      body = re.search(r"\bbody=%?([\w.\-]+)", line)
      trip = _trip_count(line, comps, defs) if body else 1
      for callee in re.findall(r"(?:calls|to_apply|condition|body|branch_computations)=\{?%?([\w.\-]+)", line):
        if callee in calls:
          calls[callee].append((name, trip if body and callee == body.group(1) else 1))
      for callee in re.findall(r"branch_computations=\{([^}]*)\}", line):
        for c in re.findall(r"%?([\w.\-]+)", callee):
          if c in calls:
            calls[c].append((name, 1))

  memo = {}

  def times(name, seen=()):
    if name == entry:
      return 1
    if name in memo:
      return memo[name]
    memo[name] = sum(times(caller, seen + (name,)) * f for caller, f in calls.get(name, []) if caller not in seen)
    return memo[name]

  return comps, times


def _executed(hlo: str):
  """(instruction line, executions per step) for every instruction of a computation the step runs, and all the
  module's lines (for name lookups)."""
  comps, times = _computations(hlo)
  runs = [(line, n) for name, lines in comps.items() for n in [times(name)] if n for line in lines]
  return runs, [line for lines in comps.values() for line in lines]


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?\s*[a-z]+\d*\[([\d,]*)\]")


def _dims(text: str) -> list:
  return [int(d) for d in text.split(",") if d]


def _contracted_size(line: str, shapes: dict):
  """Contracted elements per output element of a matmul instruction (dot, TPU dot-convolution, cuBLAS call);
  None for anything else."""
  if re.search(r"\sdot\(", line):
    args, dims = line.split(" dot(", 1)[1], re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
  elif "custom-call(" in line and '"gemm_backend_config"' in line:
    args, dims = line.split("custom-call(", 1)[1], re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
  elif re.search(r"\sconvolution\(", line):
    args, dims = line.split(" convolution(", 1)[1], None
  else:
    return None
  inline = re.match(r"\s*[a-z]+\d*\[([\d,]*)\]", args)  # operand types printed inline (TPU)
  lhs = _dims(inline.group(1)) if inline else shapes.get(re.match(r"\s*%?([\w.\-]+)", args).group(1))
  if lhs is None:
    return None
  if dims is not None:
    return math.prod(lhs[int(i)] for i in dims.group(1).replace('"', "").split(",") if i.strip())
  # A convolution (dim_labels e.g. bf_io->bf): the lhs feature size per group, times, per spatial dim, the window
  # positions that can meet a real input element: at most ceil(size / lhs_dilate), and never more than the input
  # has (TPU writes batched matmuls as convolutions whose "spatial" dims are batch dims: a window as large as the
  # dilation, or a window over a padded input of size 1 — each output meets one real element either way).
  labels = re.search(r"dim_labels=(\w+)_\w+->", line)
  if not labels:
    return None
  lhs_labels = labels.group(1)
  groups = re.search(r"feature_group_count=(\d+)", line)
  k = lhs[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
  window = re.search(r"window=\{([^}]*)\}", line)
  if window:
    size = [int(x) for x in re.search(r"size=([\dx]+)", window.group(1)).group(1).split("x")]
    dil = re.search(r"lhs_dilate=([\dx]+)", window.group(1))
    dil = [int(x) for x in dil.group(1).split("x")] if dil else [1] * len(size)
    extent = [lhs[lhs_labels.index(str(i))] if str(i) in lhs_labels else s for i, s in enumerate(size)]
    k *= math.prod(min(-(-a // b), n) for a, b, n in zip(size, dil, extent))
  return k


def matmul_flops(hlo: str) -> float:
  """FLOPs of the matmuls in optimised (per-device) HLO text per executed step: 2 x output elements x contracted
  size, each counted once per execution (loop bodies x their trip counts). Matmuls are `dot`s, the convolutions
  TPU programs turn them into, and GPU library calls (cuBLAS custom-calls with a gemm config). XLA's cost
  analysis counts a loop body once, which under-counts gradient accumulation by the number of micro-batches;
  element-wise work is left out here (a few percent of a transformer's FLOPs)."""
  runs, every_line = _executed(hlo)
  shapes = {m.group(1): _dims(m.group(2)) for m in map(_DEF.match, every_line) if m}  # name -> first array's dims
  return sum(n * _line_flops(line, shapes) for line, n in runs)


def _line_flops(line: str, shapes: dict) -> float:
  """2 x output elements x contracted size if `line` is a matmul, else 0."""
  m = _DEF.match(line)
  k = _contracted_size(line, shapes) if m else None
  return 2.0 * math.prod(shapes[m.group(1)]) * k if k else 0.0


# XLA's rematerialisation pass (run when a program would not fit the device's memory) recomputes values instead of
# keeping them; its clones are named after the original with a ".remat" / ".remat_compressed" suffix.
_REMAT = re.compile(r"\.remat(?:\d+|_compressed)?(?:\.|$)")


def compiler_remat(hlo: str) -> dict:
  """What XLA's own rematerialisation added to optimised HLO text (none when the program fits without it):
  {"instructions": clones it made, "matmul_flops": the matmuls they recompute per executed step (already in
  `matmul_flops`), counted through the fusions they call}. Not `config.remat`, which rewrites the program before
  XLA sees it."""
  comps, times = _computations(hlo)
  shapes = {m.group(1): _dims(m.group(2)) for lines in comps.values() for m in map(_DEF.match, lines) if m}
  memo = {}

  def per_call(name):  # matmul FLOPs of one call of a computation, through the computations it calls
    if name not in memo:
      memo[name] = 0.0
      memo[name] = sum(_line_flops(line, shapes) + sum(per_call(c) for c in _callees(line))
                       for line in comps.get(name, []))
    return memo[name]

  count, flops = 0, 0.0
  for name, lines in comps.items():
    for line in lines:
      m = _DEF.match(line)
      if m and _REMAT.search(m.group(1)):
        count += 1
        flops += times(name) * (_line_flops(line, shapes) + sum(per_call(c) for c in _callees(line)))
  return {"instructions": count, "matmul_flops": flops}


def _callees(line: str) -> list:
  return re.findall(r"\bcalls=%?([\w.\-]+)", line)


def replica_groups(line: str):
  """The device groups of a collective instruction line, as lists of partition ids (indices into the program's
  device assignment: for a jit over a Mesh, `mesh.devices.flat`): `replica_groups={{0,1},{2,3}}`, the iota form
  `[2,4]<=[8]` / `[2,4]<=[2,2,2]T(1,0,2)`, or a collective-permute's `source_target_pairs={{0,1},...}` (each pair a
  group). [] for `{}` (every device, one group) or when the line has none."""
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  if pairs:
    return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)", pairs.group(1) + "}")]
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if iota:
    shape, dims = _dims(iota.group(1)), _dims(iota.group(2))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose(_dims(iota.group(3)))
    return ids.reshape(shape[0], -1).tolist()
  listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if listed:
    return [_dims(g) for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
  return []


def crosses(line: str, granule_of) -> bool:
  """Whether a collective's groups join devices of different granules (slices / hosts: `granule_of[partition id]`);
  a collective over every device (no groups listed) crosses when there is more than one granule."""
  groups = replica_groups(line)
  if not groups:
    return len(set(granule_of)) > 1
  return any(len({granule_of[i] for i in g}) > 1 for g in groups)


def collective_stats(hlo: str, granule_of=None) -> dict:
  """{kind: {"count", "bytes"}} of the collectives in optimised HLO text, per executed step: an op inside a loop
  body counts once per iteration (XLA's known_trip_count), nested loops multiply. With `granule_of` (per partition
  id, the slice or host its device is in: `sharding.granule_of(mesh)`), also "dcn_count" / "dcn_bytes": those of
  the collectives whose groups span granules, i.e. that cross the slow network (their whole size is counted: what
  a flat algorithm sends; hierarchical ones send less of it across)."""
  stats = {k: {"count": 0, "bytes": 0, **({"dcn_count": 0, "dcn_bytes": 0} if granule_of is not None else {})}
           for k in COLLECTIVES}

  def add(kind, n, size, dcn):
    stats[kind]["count"] += n
    stats[kind]["bytes"] += n * size
    if dcn:
      stats[kind]["dcn_count"] += n
      stats[kind]["dcn_bytes"] += n * size

  pattern = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$")
  for line, n in _executed(hlo)[0]:
    m = pattern.search(line)
    if m:
      kind, start = m.group(2), bool(m.group(3))
      out = _array_bytes(m.group(1))  # combined collectives return a tuple: every array counts
      if start and kind in ("all-gather", "collective-permute"):  # their async result also holds the inputs
        out -= _array_bytes(m.group(4).split("),", 1)[0].split("), ", 1)[0])
      add(kind, n, max(out, 0), granule_of is not None and crosses(line, granule_of))
      continue
    # A multi-slice TPU program: XLA's TPU compiler splits a collective that spans slices into one inside each
    # slice (above) and host transfers over the data-center network, `send`s handled by "xla_megascale_runtime" and
    # tagged with the collective they implement; what each chip sends is their payload.
    m = _MEGASCALE_SEND.search(line)
    if m and "xla_megascale_runtime" in line:
      add(_MEGASCALE_KIND.get(m.group(2), "collective-permute"), n, _array_bytes(m.group(1)), granule_of is not None)
  return stats


_MEGASCALE_SEND = re.compile(r"=\s*\(([a-z]+\d*\[[\d,]*\]).*?\)\s+send\(.*_xla_megascale_transfer_type=\"(\w+)\"")
_MEGASCALE_KIND = {"ALL_GATHER": "all-gather", "ALL_REDUCE": "all-reduce", "REDUCE_SCATTER": "reduce-scatter",
                   "ALL_TO_ALL": "all-to-all"}  # and ONE_TO_ONE (point to point): collective-permute
