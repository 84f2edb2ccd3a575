"""A GGUF loaded with float weights from its own tensors (gguf_model.load_float): what models.load takes for a GPU,
bfloat16 (or any dtype but float32) and --forward graphs, instead of transformers' conversion. Every weight is the
value transformers' GGUF loader gives (float32: the same bits; bfloat16: those bits rounded), the lean and
graph-safe forwards give the logits they give on transformers' model, and a load holds one chunk of float32
values at a time, never the model in float32."""

import json
import shutil
import tracemalloc

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Type

from codespec.config import ModelConfig, SamplingParams, SpecConfig
from codespec.engine import Engine
from codespec.errors import CodespecError
from codespec.forward import LeanLlama, Rows, forward_path, gguf_model, models
from codespec.forward.graphs import GraphLlama
from tests.gguf_files import add_weights, close, k_quant_model, q4_k_m
from tests.tiny import EOS, tiny_arch_model, tiny_tokenizer


def write_gguf(path, model, projections=Type.Q8_0, output=Type.Q8_0, tied=False):
    """The model's weights in a GGUF with the metadata llama.cpp's converter writes (what transformers' GGUF loader
    and gguf_model.metadata read: the shape, rope, norms' epsilon, and the tokenizer's vocabulary and merges), laid
    out as tests/gguf_files.write_gguf lays them (q/k permuted for Llama). tied: no output.weight (the output layer
    is the embedding). projections: a type, or a function of the tensor's name giving one."""
    config = model.config
    kind = config.model_type
    writer = gguf.GGUFWriter(str(path), kind)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters.get("rope_theta", 10000.0))  # (Gemma 3's: per layer type)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if kind == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    state = json.loads(tiny_tokenizer().backend_tokenizer.to_str())
    tokens = [token for token, _ in sorted(state["model"]["vocab"].items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == "<eos>" else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    writer.add_eos_token_id(EOS)

    add_weights(writer, model, kind == "llama", projections, output, tied)
    return close(writer, path)


def transformers_model(path, dtype=torch.float32):
    """The GGUF as transformers' GGUF loader gives it (the conversion's first step, in float32): every tensor
    dequantized by gguf in float32, Llama's q and k rows put back, then cast to `dtype` (its rotary frequencies stay
    float32, as a checkpoint loaded in bfloat16 keeps them). (Its config mapping misses a Qwen3 head size wider than
    hidden / heads, attention.key_length: set from the file, as gguf_model.metadata does.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.head_dim = gguf_model.field(path, f"{gguf_model.block_tiles.architecture(path)}.attention.key_length")
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                dtype=dtype).eval()


# (architecture, projections' type, the embedding's and output layer's, tied): F32, F16, BF16 and block types,
# Llama's permuted q/k, Qwen2's q/k/v biases, Qwen3's q/k norms, an output layer that is the embedding
CASES = [("llama", Type.F32, Type.F32, False), ("llama", Type.Q8_0, Type.Q8_0, True),
         ("llama", q4_k_m, Type.Q6_K, False), ("qwen2", Type.F16, Type.F16, False),
         ("qwen2", Type.Q4_K, Type.Q8_0, True), ("qwen3", Type.Q8_0, Type.F16, False),
         ("qwen3", Type.BF16, Type.Q4_0, False)]


def case_model(kind, projections):
    k_quants = projections is q4_k_m or getattr(projections, "name", "").endswith("_K")
    return k_quant_model(kind) if k_quants else tiny_arch_model(kind, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind, projections, output, tied", CASES,
                         ids=[f"{c[0]}-{getattr(c[1], 'name', 'Q4_K_M')}-{c[2].name}{'-tied' * c[3]}" for c in CASES])
def test_every_weight_is_transformers_dequantized_value_and_the_forwards_give_its_logits(tmp_path, kind, projections,
                                                                                         output, tied, dtype):
    model = case_model(kind, projections)
    path = write_gguf(tmp_path / "model.gguf", model, projections, output, tied)
    ours, tokenizer = gguf_model.load_float(path, tmp_path / "meta", dtype, "cpu")
    reference = transformers_model(path)  # (float32)
    assert isinstance(ours, gguf_model.DirectModel) and ours.gguf_direct is None and ours.gguf_float == path
    assert ours.dtype == dtype and ours.device.type == "cpu"
    mine = dict(ours.named_parameters(remove_duplicate=False))
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    assert sorted(mine) == sorted(theirs)
    for name, values in mine.items():
        assert values.dtype == dtype and not values.requires_grad, name
        assert torch.equal(values, theirs[name].to(dtype)), name
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    if projections is Type.F32:  # the file holds the model's own values: q and k back in the model's order
        for name, values in model.named_parameters():
            assert torch.equal(mine[name], values.to(dtype)), name
    assert tokenizer("def f(x):")["input_ids"] == tiny_tokenizer()("def f(x):")["input_ids"]  # (from the metadata)

    # the lean and graph-safe forwards give on this model what they give on transformers' (cast to the dtype)
    cast = transformers_model(path, dtype)
    assert all(torch.equal(a, b.to(dtype)) for a, b in zip(cast.parameters(), reference.parameters()))
    ids = list(range(5, 45))
    for build in (lambda m: forward_path(m), lambda m: forward_path(m, graphs=True)):
        got, want = build(ours), build(cast)
        assert isinstance(got, GraphLlama if isinstance(want, GraphLlama) else LeanLlama)
        caches = got.new_cache(), want.new_cache()
        assert torch.equal(got.batch([Rows(caches[0], ids, 3, prompt=True)])[0],
                           want.batch([Rows(caches[1], ids, 3, prompt=True)])[0])
        assert torch.equal(got(caches[0], [7, 8], 2), want(caches[1], [7, 8], 2))
    # transformers' own forward on these weights (shared, not copied): its logits on its model of the file
    shared = ours.transformers()
    assert shared.model.layers[1].mlp.up_proj.weight is mine["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(ours(torch.tensor([ids])).logits, cast(torch.tensor([ids])).logits)
    # and in float32: within float32 sums in another order (bfloat16: its rounding)
    full = reference(torch.tensor([ids])).logits[0, -3:]
    graphs = forward_path(ours, graphs=True)
    logits = graphs(graphs.new_cache(), ids, 3).float()
    # (measured: float32 at most 8e-6; bfloat16 0.7% to 4.3% of the largest logit, the K-quant models' wider sums)
    tolerance = 2e-4 if dtype == torch.float32 else 0.1 * full.abs().max().item()
    assert (logits - full).abs().max().item() < tolerance


def test_models_load_takes_the_float_path_on_a_gpu_in_bfloat16_or_for_graphs(tmp_path, monkeypatch):
    """models.load: bfloat16 (or float16) and --forward graphs read the file's tensors (no conversion: `pull` is
    never called); a CPU in float32 with the lean forward is read directly as before (its weights placeholders);
    --forward transformers, `extra` (from_pretrained's) and another architecture convert."""
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    pulled = []

    def pull(model, show_progress=True):
        pulled.append(model)
        raise RuntimeError("converted")

    monkeypatch.setattr(models, "pull", pull)
    path = write_gguf(tmp_path / "model.gguf", tiny_arch_model("qwen2", dtype=torch.float32), Type.Q8_0)
    file = str(path)
    for settings, dtype in (({"forward": "graphs", "dtype": "bfloat16"}, torch.bfloat16),
                            ({"dtype": "bf16"}, torch.bfloat16), ({"dtype": "float16"}, torch.float16),
                            ({"forward": "graphs"}, torch.float32)):
        model, _ = models.load(ModelConfig(model=file, device="cpu", **settings), show_progress=False)
        assert model.gguf_float == path and model.gguf_direct is None and model.dtype == dtype, settings
        assert model.model.layers[1].self_attn.q_proj.bias.dtype == dtype
        assert model.model.embed_tokens.weight.untyped_storage().nbytes() == 384 * 64 * dtype.itemsize
    assert pulled == []
    assert (tmp_path / "home" / "models").is_dir()  # (the config and tokenizer kept beside, as read directly)
    model, _ = models.load(ModelConfig(model=file, device="cpu"), show_progress=False)
    assert model.gguf_direct == path and model.model.embed_tokens.weight.untyped_storage().nbytes() == 4
    for settings in ({"forward": "transformers", "dtype": "bfloat16"},
                     {"forward": "graphs", "extra": {"max_position_embeddings": 256}}):
        with pytest.raises(RuntimeError, match="converted"):
            models.load(ModelConfig(model=file, device="cpu", **settings), show_progress=False)
    assert pulled == [file, file]
    gemma = write_gguf(tmp_path / "gemma.gguf", tiny_arch_model("gemma3", dtype=torch.float32))
    assert gguf_model.float_problem(gemma) == "architecture 'gemma3_text' (read directly: llama, qwen2, qwen3)"
    assert models.float_gguf(ModelConfig(model=str(gemma), dtype="bfloat16"), "cpu") is None
    # a type the block kernels do not read (not read directly) still loads with float weights
    bf16 = write_gguf(tmp_path / "bf16.gguf", tiny_arch_model("llama", dtype=torch.float32), Type.BF16)
    assert gguf_model.direct_problem(bf16) == "blk.0.attn_q.weight is BF16" and gguf_model.float_problem(bf16) is None
    assert models.float_gguf(ModelConfig(model=str(bf16), dtype="bfloat16"), "cpu") == bf16


def test_a_model_the_lean_forward_does_not_run_is_converted(tmp_path, monkeypatch):
    """Where the metadata describes what the lean forward does not run (here the MLP's biases), load_float gives
    None and models.load converts (transformers' own forward runs it)."""
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    model = tiny_arch_model("llama", dtype=torch.float32)
    path = write_gguf(tmp_path / "model.gguf", model)
    folder = tmp_path / "meta"
    assert gguf_model.load_float(path, folder, torch.bfloat16, "cpu") is not None
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(saved | {"mlp_bias": True}))
    assert gguf_model.load_float(path, folder, torch.bfloat16, "cpu") is None
    _, target = models.model_source(str(path))
    shutil.copytree(folder, target.with_name(target.name + "-direct"))  # (where models.load keeps the metadata)
    monkeypatch.setattr(models, "pull", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("converted")))
    with pytest.raises(RuntimeError, match="converted"):
        models.load(ModelConfig(model=str(path), device="cpu", dtype="bfloat16"), show_progress=False)


def test_a_file_too_large_or_whose_metadata_does_not_match_its_tensors_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "model.gguf", tiny_arch_model("qwen3", dtype=torch.float32))
    needed = models.gguf_parameters(path) * 2  # (bfloat16)
    assert needed == 2 * sum(p.numel() for p in tiny_arch_model("qwen3", dtype=torch.float32).parameters())
    monkeypatch.setattr(models, "available_memory", lambda: needed)
    with pytest.raises(CodespecError, match=r"loading model.gguf takes about .* MB of memory and 0 MB is available"):
        models.load(ModelConfig(model=str(path), device="cpu", dtype="bfloat16"), show_progress=False)
    monkeypatch.setattr(models, "available_memory", lambda: None)
    folder = tmp_path / "meta"
    gguf_model.load_float(path, folder, torch.bfloat16, "cpu")
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(saved | {"intermediate_size": 96}))
    with pytest.raises(CodespecError, match="model.gguf's metadata does not match its tensors: blk.0.ffn_gate.weight "
                                            "has 8192 values, the model its metadata describes 6144"):
        gguf_model.load_float(path, folder, torch.bfloat16, "cpu")


def test_the_engine_generates_on_it_what_it_generates_on_transformers_model(tmp_path, monkeypatch):
    """Engine.load with --forward graphs --dtype bfloat16 (a GPU's settings, on this CPU): the text is the one the
    same forward gives on transformers' model of the file, cast to bfloat16."""
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "model.gguf", tiny_arch_model("llama", dtype=torch.float32), Type.Q4_0)
    engine = Engine.load(ModelConfig(model=str(path), device="cpu", dtype="bfloat16", forward="graphs"),
                         show_progress=False)
    assert engine.model.gguf_float == path and isinstance(engine.path, GraphLlama)
    reference = Engine(transformers_model(path, torch.bfloat16), tiny_tokenizer(), SpecConfig(),
                       eos_token_ids=frozenset({EOS}), forward="graphs")
    prompt = "def add(a, b):\n    return"
    for spec in (SpecConfig(spec=("none",)), SpecConfig(spec=("prompt-lookup",))):
        ours = engine.generate(prompt, SamplingParams(max_tokens=24), spec=spec)
        theirs = reference.generate(prompt, SamplingParams(max_tokens=24), spec=spec)
        assert ours.tokens == theirs.tokens and len(ours.tokens) > 0
    # transformers' own generate (the bench's transformers rows): on these weights as on its model of the file
    ids = torch.tensor([engine.encode(prompt)])
    assert torch.equal(engine.transformers_model.generate(ids, max_new_tokens=12, do_sample=False),
                       reference.model.generate(ids, max_new_tokens=12, do_sample=False))


def test_a_load_holds_a_chunk_of_float32_values_never_the_model(tmp_path, monkeypatch):
    """Every tensor is dequantized CHUNK_VALUES values at a time (gguf.quants.dequantize never returns more), each
    read once; the load's peak of numpy's (and Python's) memory is a small part of the model in float32, where
    transformers' GGUF loader holds every tensor in float32 at once (over the model's size)."""
    from gguf import quants

    model = k_quant_model("llama")
    path = write_gguf(tmp_path / "model.gguf", model, q4_k_m, Type.Q6_K)
    gguf_model.load_float(path, tmp_path / "meta", torch.bfloat16, "cpu")  # (the metadata kept: read once)
    sizes, dequantize = [], quants.dequantize
    monkeypatch.setattr(quants, "dequantize", lambda *args: sizes.append(dequantize(*args).size) or dequantize(*args))
    monkeypatch.setattr(gguf_model, "CHUNK_VALUES", 8192)
    float32_bytes = 4 * sum(p.numel() for p in model.parameters())
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    shape = transformers_model(path)  # (what transformers' loader maps the file's names onto)
    tracemalloc.start()
    try:
        loaded, _ = gguf_model.load_float(path, tmp_path / "meta", torch.bfloat16, "cpu")
        ours = tracemalloc.get_traced_memory()[1]
        monkeypatch.setattr(quants, "dequantize", dequantize)
        tracemalloc.reset_peak()
        held = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shape)
        theirs = tracemalloc.get_traced_memory()[1]
        del held
    finally:
        tracemalloc.stop()
    assert max(sizes) <= 8192 and sum(sizes) == sum(p.numel() for p in loaded.parameters())
    assert ours < float32_bytes / 8 < float32_bytes < theirs, (ours, float32_bytes, theirs)
