"""Load a local Hugging Face checkpoint (any family of models/families.py) into torchtitan's decoder.

Names and layouts are translated by the family's torchtitan state-dict
adapter; the fused ``wqkv`` is rebuilt from HF's q/k/v by the model's load hook
(whole model) or by ``qkv_views`` (sharded).

Two ways in: ``load_hf_weights`` reads every tensor into an unsharded model
(each rank the whole checkpoint); ``load_hf_weights_sharded`` fills an
FSDP-sharded model with torch.distributed.checkpoint's HF reader, each rank
reading only the rows of its shards (safetensors slices), the q/k/v of one
layer at a time for the fused projection.
"""

from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_rl.models.families import from_hf, load_hf_state, to_hf
from torchtitan_rl.models.shape import ModelShape, qkv_views

_WQKV = "attention.qkv_linear.wqkv.weight"


def _files(hf_dir: str | Path) -> list[Path]:
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.hf_checkpoint: no *.safetensors files in {hf_dir}")
    return files


def load_hf_weights(model: nn.Module, *, shape: ModelShape, hf_dir: str | Path) -> None:
    """Copy the weights of ``hf_dir``/*.safetensors into an unsharded ``model`` (casting)."""
    hf_state = {}
    for file in _files(hf_dir):
        try:
            hf_state.update(safetensors.torch.load_file(file))
        except safetensors.SafetensorError as e:
            raise ValueError(f"model.hf_checkpoint: {file}: not a whole safetensors file ({e})") from None
    load_hf_state(model, hf_state, shape, where=f"model.hf_checkpoint: {hf_dir}")


def _hf_names(shape: ModelShape, native: dict[str, torch.Tensor]) -> dict[str, str]:
    """Our parameter name -> the HF tensor it is read from, for every parameter but the fused wqkv (a rename
    in every family: the adapters permute only q and k)."""
    names = {}
    for name, t in native.items():
        if not name.endswith(_WQKV):
            (hf_name,) = to_hf({name: torch.empty(t.shape, device="meta")}, shape)
            names[name] = hf_name
    return names


def _qkv_hf_names(shape: ModelShape, prefix: str, wqkv_shape: torch.Size) -> dict[str, str]:
    """HF names of layer ``prefix``'s q/k/v projections, by our checkpoint names (wq, wk, wv)."""
    views = qkv_views(torch.empty(wqkv_shape, device="meta"), shape)
    meta = {f"{prefix}attention.qkv_linear.{k}.weight": v.reshape(-1, wqkv_shape[-1]) for k, v in views.items()}
    return {k.split(".")[-2]: next(iter(to_hf({k: v}, shape))) for k, v in meta.items()}


@torch.no_grad()
def load_hf_weights_sharded(model: nn.Module, *, shape: ModelShape, hf_dir: str | Path) -> None:
    """Fill the parameters of an FSDP-sharded ``model`` (DTensors, collectively on every rank) from ``hf_dir``;
    each rank reads only its shards' rows. ValueError naming the checkpoint unless it matches the model."""
    _files(hf_dir)
    where = f"model.hf_checkpoint: {hf_dir}"
    reader = dcp.HuggingFaceStorageReader(str(hf_dir))
    stored = {k: v.size for k, v in reader.read_metadata().state_dict_metadata.items()}
    params = dict(model.named_parameters())
    names = _hf_names(shape, params)
    layers = [name[: -len(_WQKV)] for name in params if name.endswith(_WQKV)]
    qkv_names = {p: _qkv_hf_names(shape, p, params[p + _WQKV].shape) for p in layers}
    wanted = set(names.values()) | {n for hf in qkv_names.values() for n in hf.values()}
    missing = sorted(wanted - stored.keys())
    extra = sorted(k for k in stored.keys() - wanted if not (shape.tie_word_embeddings and k == "lm_head.weight"))
    wrong = [f"{hf} {tuple(stored[hf])} != {tuple(params[n].shape)}" for n, hf in names.items()
             if hf in stored and tuple(stored[hf]) != tuple(params[n].shape)]
    if missing or extra or wrong:
        raise ValueError(f"{where} does not match the model: missing {missing[:5]}, unexpected {extra[:5]}, "
                         f"wrong shape {wrong[:5]}")
    # Plain renames: DCP reads each rank's rows straight into its shard (casting to the master dtype).
    dcp.load({hf: params[n] for n, hf in names.items()}, storage_reader=reader)
    for prefix in layers:  # the fused projection: one layer's whole q/k/v, fused, then this rank's rows
        hf = qkv_names[prefix]
        dtype = params[prefix + _WQKV].dtype
        qkv = {name: torch.empty(stored[name], dtype=dtype) for name in hf.values()}
        dcp.load(qkv, storage_reader=reader)
        if shape.tie_word_embeddings:  # the adapter's tie check wants the embedding or a head in a partial dict
            qkv["lm_head.weight"] = torch.empty(1, device="meta")
        ours = from_hf(qkv, shape)
        wqkv = params[prefix + _WQKV]
        full = torch.empty(wqkv.shape, dtype=dtype)
        for key, view in qkv_views(full, shape).items():
            view.copy_(ours[f"{prefix}attention.qkv_linear.{key}.weight"].view(view.shape))
        if isinstance(wqkv, DTensor):
            full = distribute_tensor(full, wqkv.device_mesh, wqkv.placements, src_data_rank=None).to_local()
            wqkv = wqkv.to_local()
        wqkv.copy_(full)
