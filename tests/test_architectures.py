"""Every architecture the adapter lists is cut exactly: tiny random-weight models of
each, cut into chains at several points, against the whole model bit for bit.

The embedded SmolLM2 (tests/test_parity.py) is one llama model in one quantization
(Q4_1). Here each architecture in ``supported_architectures()`` gets a tiny model
written with gguf-py's GGUFWriter, carrying the metadata keys and tensors that the
pinned llama.cpp's loader reads for it (src/models/<arch>.cpp, load_arch_hparams and
load_arch_tensors) including the parts that set it apart from llama: qwen2's q/k/v
biases, qwen3's per-head q/k norms and head size apart from n_embd / n_head,
mistral3's YaRN RoPE and llama-4 attention temperature (both scaled by position,
with an original context short enough that the prompt crosses its steps), and
llama's shared ``rope_freqs`` tensor. It is written in f32 and quantized by
llama.cpp's own quantizer (llama_model_quantize) to F16, Q8_0, Q6_K and Q4_K_M
(Q4_K_M mixes Q4_K and Q6_K per layer by layer index in the whole model, which a
cut must carry over as is).

Each chain is checked at every seam (the hidden rows a shard hands on, against the
whole model's ``l_out-<k>`` captured in a plain llama.cpp context) and at the tail
(the logits of the prompt and of every decode step), bytes equal, not close.
"""

from __future__ import annotations

import ctypes

import gguf
import llama_cpp
import numpy as np
import pytest

from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.engine.adapters import supported_architectures
from meshnet_p2p.engine.contract import HIDDEN
from meshnet_p2p.engine.cut import cut_shard, sha256_file
from meshnet_p2p.engine.gguf import read_gguf
from meshnet_p2p.engine.llama_native import ensure_backend, ggml_base

from tests.conftest import N_UBATCH
from tests.reference import reference_generate

N_LAYER = 6
N_EMBD = 256  # k-quant rows are whole 256-element super-blocks
N_FF = 512
N_HEAD, N_HEAD_KV = 4, 2
N_EXPERT = 4  # the "moe" variant: 4 experts, 2 used a token
PROMPT_LEN = 2 * N_UBATCH + 7  # three micro-batches, the last one short
MAX_TOKENS = 5  # the prompt's token, then four decode steps

# The whole model, then chains: each string lists the layers a chain is cut at.
SPLITS = ["", "1", "3", "5", "2,4", "1,5", "1,2,3,4,5"]

FTYPES = {
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
}


# --- tiny models ------------------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


# A minimal byte-level BPE vocabulary (what SmolLM2, Llama 3, Qwen and Tekken carry,
# cut down): every byte, two merges, two control tokens.
TOKENS = [*_bytes_to_unicode(), "Ġt", "he", "<|endoftext|>", "<|im_end|>"]
TOKEN_TYPES = [gguf.TokenType.NORMAL] * (len(TOKENS) - 2) + [gguf.TokenType.CONTROL] * 2
MERGES = ["Ġ t", "h e"]
N_VOCAB = len(TOKENS)
TOKENIZER_PRE = {"llama": "llama-bpe", "mistral3": "tekken", "qwen2": "qwen2", "qwen3": "qwen2", "gemma3": "default"}


def write_tiny_model(path: str, arch: str, *, seed: int = 0, variant: str = "") -> str:
    """A random-weight f32 GGUF of ``arch`` with the keys and tensors the pinned
    llama.cpp loads for it. ``variant``: "lm_head_bias" adds the optional
    ``output.bias`` (qwen2's loader takes one); "per_layer_arrays" writes the head
    counts and FFN width as per-layer arrays (llama.cpp reads either form);
    "no_yarn" / "no_temperature" leave out mistral3's YaRN / attention temperature keys;
    "moe" gives llama / mistral3 a Mixtral-style mixture of experts instead of one FFN;
    gemma3's sliding-window layers are by default llama.cpp's il % 6 rule (layer 5
    global), "swa_period" sets its integer period to 3 (layers 2 and 5 global),
    "swa_array" writes a per-layer array (layers 0 and 3 global), "no_swa" leaves
    the window out (every layer global)."""
    assert variant in (
        "", "lm_head_bias", "per_layer_arrays", "no_yarn", "no_temperature", "moe", "swa_period", "swa_array", "no_swa"
    ), variant
    rng = np.random.default_rng([seed, *arch.encode()])
    head_dim = {"qwen3": 128, "mistral3": 128, "gemma3": 128}.get(arch, N_EMBD // N_HEAD)
    n_q, n_kv = N_HEAD * head_dim, N_HEAD_KV * head_dim
    tied = arch in ("qwen2", "qwen3", "gemma3")

    def mat(rows: int, cols: int) -> np.ndarray:  # GGUF dims (cols, rows): numpy (rows, cols)
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(N_LAYER)
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    per_layer = (lambda v: [v] * N_LAYER) if variant == "per_layer_arrays" else (lambda v: v)
    w.add_feed_forward_length(per_layer(N_FF))
    w.add_head_count(per_layer(N_HEAD))
    w.add_head_count_kv(per_layer(N_HEAD_KV))
    w.add_layer_norm_rms_eps(1e-6)
    if variant == "moe":
        assert arch in ("llama", "mistral3"), arch
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(2)
    w.add_rope_freq_base(1e6 if arch.startswith("qwen") else 1e4)
    if head_dim != N_EMBD // N_HEAD:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "mistral3"):
        w.add_vocab_size(N_VOCAB)
        w.add_rope_dimension_count(head_dim)
    if arch == "mistral3":  # Ministral 3's YaRN and llama-4 attention temperature (conversion/mistral3.py)
        w.add_rope_scaling_orig_ctx_len(16)  # short: the prompt's positions cross the temperature's steps
        if variant != "no_yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(16.0)
            w.add_rope_scaling_yarn_beta_fast(32.0)
            w.add_rope_scaling_yarn_beta_slow(1.0)
            w.add_rope_scaling_yarn_log_mul(1.0)
        if variant != "no_temperature":
            w.add_attn_temperature_scale(0.1)
    if arch == "gemma3" and variant != "no_swa":
        w.add_sliding_window(8)  # short, so the prompt (and every decode step) is past the window
        w.add_rope_freq_base_swa(1e3)  # not the global layers' 1e4, so a layer run as the wrong kind shows
        if variant == "swa_period":
            w.add_sliding_window_pattern(3)
        elif variant == "swa_array":
            w.add_sliding_window_pattern([i % 3 != 0 for i in range(N_LAYER)])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(TOKENIZER_PRE[arch])
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    w.add_eos_token_id(TOKENS.index("<|im_end|>"))
    w.add_add_bos_token(False)

    w.add_tensor("token_embd.weight", mat(N_VOCAB, N_EMBD))
    if arch == "llama":  # Llama 3's RoPE frequency factors: one tensor shared by every layer
        w.add_tensor("rope_freqs.weight", (1.0 + rng.random(head_dim // 2) * 3).astype(np.float32))
    for i in range(N_LAYER):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm(N_EMBD))
        w.add_tensor(b + "attn_q.weight", mat(n_q, N_EMBD))
        w.add_tensor(b + "attn_k.weight", mat(n_kv, N_EMBD))
        w.add_tensor(b + "attn_v.weight", mat(n_kv, N_EMBD))
        if arch == "qwen2":
            for t, n in (("q", n_q), ("k", n_kv), ("v", n_kv)):
                w.add_tensor(b + f"attn_{t}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            w.add_tensor(b + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(b + "attn_k_norm.weight", norm(head_dim))
        w.add_tensor(b + "attn_output.weight", mat(N_EMBD, n_q))
        if arch == "gemma3":
            w.add_tensor(b + "post_attention_norm.weight", norm(N_EMBD))
        w.add_tensor(b + "ffn_norm.weight", norm(N_EMBD))
        if variant == "moe":  # GGUF dims (n_embd, n_ff, n_expert): numpy (n_expert, n_ff, n_embd)
            w.add_tensor(b + "ffn_gate_inp.weight", mat(N_EXPERT, N_EMBD))
            w.add_tensor(b + "ffn_gate_exps.weight", np.stack([mat(N_FF, N_EMBD) for _ in range(N_EXPERT)]))
            w.add_tensor(b + "ffn_up_exps.weight", np.stack([mat(N_FF, N_EMBD) for _ in range(N_EXPERT)]))
            w.add_tensor(b + "ffn_down_exps.weight", np.stack([mat(N_EMBD, N_FF) for _ in range(N_EXPERT)]))
        else:
            w.add_tensor(b + "ffn_gate.weight", mat(N_FF, N_EMBD))
            w.add_tensor(b + "ffn_up.weight", mat(N_FF, N_EMBD))
            w.add_tensor(b + "ffn_down.weight", mat(N_EMBD, N_FF))
        if arch == "gemma3":
            w.add_tensor(b + "post_ffw_norm.weight", norm(N_EMBD))
    w.add_tensor("output_norm.weight", norm(N_EMBD))
    if not tied:
        w.add_tensor("output.weight", mat(N_VOCAB, N_EMBD))
    if variant == "lm_head_bias":
        w.add_tensor("output.bias", (0.1 * rng.standard_normal(N_VOCAB)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(src: str, dst: str, ftype: int) -> str:
    """``src`` quantized by llama.cpp's own quantizer to llama_ftype ``ftype``."""
    ensure_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = ftype
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed ({rc})"
    return dst


# --- the whole model, with its residual stream after every layer ---------------------


_ggml = ggml_base()
_ggml.ggml_get_name.restype, _ggml.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
_ggml.ggml_nbytes.restype, _ggml.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
_ggml.ggml_backend_tensor_get.restype = None
_ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]


def whole_model_hidden(model_path: str, prompt: list[int], max_tokens: int) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
    """Greedy run of the whole model in one plain llama.cpp context (as tests/reference.py),
    capturing every layer's output ``l_out-<il>`` (all rows of every micro-batch, in
    order): the logits per step and {layer: rows x n_embd}."""
    ensure_backend()
    captured: dict[int, list[np.ndarray]] = {}

    def on_node(tensor, ask, _user):
        name = _ggml.ggml_get_name(tensor).decode()
        if not name.startswith("l_out-"):
            return not ask  # not asked for; and keep computing
        if ask:
            return True
        n = _ggml.ggml_nbytes(tensor)
        buf = np.empty(n // 4, dtype=np.float32)
        _ggml.ggml_backend_tensor_get(tensor, buf.ctypes.data, 0, n)
        captured.setdefault(int(name[len("l_out-"):]), []).append(buf.reshape(-1, N_EMBD))
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_node)
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
    assert model
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 512
    cp.n_batch = 512
    cp.n_ubatch = N_UBATCH
    cp.n_seq_max = 1
    cp.flash_attn_type = 0
    cp.n_threads = cp.n_threads_batch = 2
    cp.cb_eval = callback
    cp.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(model, cp)
    assert ctx
    batch = llama_cpp.llama_batch_init(len(prompt), 0, 1)
    logits: list[np.ndarray] = []
    try:
        feed, pos = list(prompt), 0
        for _ in range(max_tokens):
            batch.n_tokens = len(feed)
            for i, t in enumerate(feed):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = int(i == len(feed) - 1)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            pos += len(feed)
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(N_VOCAB,)).copy()
            logits.append(row)
            feed = [int(np.argmax(row))]
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return logits, {il: np.concatenate(rows) for il, rows in captured.items()}


# --- fixtures ----------------------------------------------------------------------


ARCHS = supported_architectures()
WRITABLE = ("llama", "mistral3", "qwen2", "qwen3", "gemma3")  # what write_tiny_model writes


def _cases() -> list:
    """Every supported architecture over every quantization type."""
    return [pytest.param(arch, ftype, id=f"{arch}-{ftype}") for arch in ARCHS for ftype in FTYPES]


class _Models:
    """Tiny models, their digests, the oracle's runs and cut shards, made once per module in tmp."""

    def __init__(self, root) -> None:
        self.root = root
        self._cache: dict = {}

    def _once(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def model(self, arch: str, ftype: str, variant: str = "") -> tuple[str, str]:
        name = f"{arch}{'-' + variant if variant else ''}"

        def make():
            base = self._once(("f32", name), lambda: write_tiny_model(str(self.root / f"{name}-f32.gguf"), arch, variant=variant))
            path = quantize(base, str(self.root / f"{name}-{ftype}.gguf"), FTYPES[ftype])
            return path, sha256_file(path)

        return self._once(("model", name, ftype), make)

    def prompt(self, arch: str) -> list[int]:
        rng = np.random.default_rng([7, *arch.encode()])
        return [int(t) for t in rng.integers(0, N_VOCAB - 2, PROMPT_LEN)]  # no control tokens

    def reference(self, arch: str, ftype: str, variant: str = ""):
        def make():
            path, _ = self.model(arch, ftype, variant)
            prompt = self.prompt(arch)
            tokens, oracle = reference_generate(path, prompt, MAX_TOKENS, n_ubatch=N_UBATCH)
            logits, hidden = whole_model_hidden(path, prompt, MAX_TOKENS)
            # the capture must not change what the whole model computes
            assert [x.tobytes() for x in logits] == [x.tobytes() for x in oracle]
            return prompt, tokens, oracle, hidden

        return self._once(("reference", arch, ftype, variant), make)

    def shard(self, arch: str, ftype: str, start: int, end: int, variant: str = "") -> str:
        def make():
            path, digest = self.model(arch, ftype, variant)
            out = str(self.root / f"{arch}-{variant}-{ftype}-{start}-{end}.gguf")
            cut_shard(path, start, end, out, source_sha256=digest)
            return out

        return self._once(("shard", arch, ftype, start, end, variant), make)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("tiny"))


def _ranges(split: str) -> list[tuple[int, int]]:
    bounds = [0, *(int(c) for c in split.split(",") if c), N_LAYER]
    return list(zip(bounds, bounds[1:]))


def _recording(engine, out: list[np.ndarray]):
    """``engine`` with every hidden-state reply it gives appended to ``out``."""
    for name in ("prefill", "decode"):
        step = getattr(engine, name)

        def wrapped(request, _step=step):
            result = _step(request)
            if result.status.ok and result.hidden is not None:
                t = result.hidden.get(HIDDEN)
                out.append(np.frombuffer(t.data, dtype=np.float32).reshape(t.shape).copy())
            return result

        setattr(engine, name, wrapped)
    return engine


def check_chain(models: _Models, load_engine, arch: str, ftype: str, split: str, variant: str = "") -> None:
    """The chain cut at ``split`` (the whole model through our engine if empty) gives
    the whole model's tokens, logits at every step and hidden rows at every seam, bytes equal."""
    prompt, ref_tokens, ref_logits, ref_hidden = models.reference(arch, ftype, variant)
    path, digest = models.model(arch, ftype, variant)
    engines, seams = [], []
    for start, end in _ranges(split):
        if (start, end) == (0, N_LAYER):
            engine = load_engine(path, source_sha256=digest)
        else:
            engine = load_engine(models.shard(arch, ftype, start, end, variant))
        if end < N_LAYER:
            seams.append((end, []))
            _recording(engine, seams[-1][1])
        engines.append(engine)
    step_logits: list[np.ndarray] = []
    sample = engines[-1]._sample

    def spy(s, logits, position):
        step_logits.append(logits.copy())
        return sample(s, logits, position)

    engines[-1]._sample = spy
    gen = LocalRoute(engines).generate(prompt, MAX_TOKENS, stop_at_eog=False)

    assert gen.token_ids == ref_tokens
    assert len(step_logits) == len(ref_logits) == MAX_TOKENS
    for i, (mine, ref) in enumerate(zip(step_logits, ref_logits, strict=True)):
        assert mine.tobytes() == ref.tobytes(), f"logits of step {i} differ"
    for end, rows in seams:
        mine = np.concatenate(rows)
        # every row the shard handed on: the prompt's, then one per decode step but the last
        assert mine.shape == (PROMPT_LEN + MAX_TOKENS - 1, N_EMBD)
        assert mine.tobytes() == ref_hidden[end - 1].tobytes(), f"hidden states at the seam after layer {end - 1} differ"


# --- tests -------------------------------------------------------------------------


def test_every_supported_architecture_is_covered():
    assert set(ARCHS) >= {"llama", "mistral3", "qwen2", "qwen3", "gemma3"}
    assert set(ARCHS) <= set(WRITABLE), "a newly supported architecture needs a tiny model in write_tiny_model"


@pytest.mark.parametrize("arch,ftype", _cases())
def test_tiny_model_is_what_llama_cpp_loads(models, arch, ftype):
    """The model loads in the pinned llama.cpp as the architecture it claims (its loader
    refuses a file with a tensor it did not ask for, so every name is one it expects),
    and the quantizer produced the types asked for."""
    path, _ = models.model(arch, ftype)
    f = read_gguf(path)
    assert f.get("general.architecture") == arch
    assert f.get("general.file_type") == FTYPES[ftype]
    types = {gguf.GGMLQuantizationType(t.ggml_type).name for t in f.tensors if t.name.startswith("blk.") and len(t.dims) == 2}
    assert types == {"F16": {"F16"}, "Q8_0": {"Q8_0"}, "Q6_K": {"Q6_K"}, "Q4_K_M": {"Q4_K", "Q6_K"}}[ftype]
    ensure_backend()
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    assert model, f"llama.cpp refused the tiny {arch} model"
    try:
        assert llama_cpp.llama_model_n_layer(model) == N_LAYER
        assert llama_cpp.llama_model_n_embd(model) == N_EMBD
        assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)) == N_VOCAB
        desc = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(model, desc, len(desc))
        assert desc.value.decode().startswith(f"{arch} ")
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"cut-{s.replace(',', '-') or 'none'}")
@pytest.mark.parametrize("arch,ftype", _cases())
def test_chain_matches_whole_model_bit_for_bit(models, load_engine, arch, ftype, split):
    check_chain(models, load_engine, arch, ftype, split)


@pytest.mark.parametrize("split", ["1", "2,4", "1,2,3,4,5"])
@pytest.mark.parametrize(
    "arch,variant", [("qwen2", "lm_head_bias"), ("llama", "per_layer_arrays"), ("llama", "moe"), ("mistral3", "moe")]
)
def test_optional_forms_the_loader_accepts_are_cut_exactly(models, load_engine, arch, variant, split):
    """An lm_head bias (qwen2's loader takes ``output.bias``; a middle shard's vocabulary
    is one token, so it must not carry one), head counts / FFN width as per-layer
    arrays (sliced with their layers), and a mixture of experts in place of the FFN
    (llama's and mistral3's loaders take one: Mixtral is a llama)."""
    check_chain(models, load_engine, arch, "Q4_K_M", split, variant)
    start, end = _ranges(split)[1]
    shard = read_gguf(models.shard(arch, "Q4_K_M", start, end, variant))
    if variant == "lm_head_bias":
        assert shard.tensor("output.bias") is None or end == N_LAYER
    elif variant == "per_layer_arrays":
        assert shard.get(f"{arch}.attention.head_count_kv") == (N_HEAD_KV,) * (end - start)
    else:
        assert shard.tensor("blk.0.ffn_up_exps.weight").dims == (N_EMBD, N_FF, N_EXPERT)


@pytest.mark.parametrize("without", ["no_yarn", "no_temperature"])
def test_mistral3_scaling_keys_are_read(models, without):
    """Guards the mistral3 model itself: its YaRN and its attention-temperature keys each
    change what it computes (a misspelt optional key would be ignored, and the chains
    would not cover what sets mistral3 apart from llama)."""
    _, _, scaled, _ = models.reference("mistral3", "F16")
    _, _, plain, _ = models.reference("mistral3", "F16", without)
    assert scaled[0].tobytes() != plain[0].tobytes()


GEMMA3_SWA = {  # which layers of the tiny gemma3 slide, per variant, as the whole model runs them
    "": (True, True, True, True, True, False),
    "swa_period": (True, True, False, True, True, False),
    "swa_array": (False, True, True, False, True, True),
}


@pytest.mark.parametrize("split", ["1", "3", "5", "2,4", "1,2,3,4,5"], ids=lambda s: f"cut-{s.replace(',', '-')}")
@pytest.mark.parametrize("variant", ["swa_period", "swa_array", "no_swa"])
def test_gemma3_sliding_window_forms_are_cut_exactly(models, load_engine, variant, split):
    """Every form llama.cpp reads gemma3's sliding-window layers from (its il % 6 rule is
    the default case above; an integer period; a per-layer array; no window at all),
    cut so that spans start and end on sliding and on global layers, and so that some
    span holds only global ones (written with no window: llama.cpp aborts on a
    windowed model without a sliding layer)."""
    check_chain(models, load_engine, "gemma3", "Q4_K_M", split, variant)
    for start, end in _ranges(split):
        shard = read_gguf(models.shard("gemma3", "Q4_K_M", start, end, variant))
        if variant == "no_swa":
            assert shard.get("gemma3.attention.sliding_window") is None
            continue
        span = GEMMA3_SWA[variant][start:end]
        assert shard.get("gemma3.attention.sliding_window_pattern") == span
        assert shard.get("gemma3.attention.sliding_window") == (8 if any(span) else 0)


def test_gemma3_sliding_window_forms_change_what_it_computes(models):
    """Guards the tiny gemma3 itself: the window is short enough for the prompt to
    cross it, and which layers slide changes the logits (so the chains above would see
    a shard that ran a layer as the wrong kind)."""
    runs = {v: models.reference("gemma3", "Q4_K_M", v)[2][0].tobytes() for v in ("", "swa_period", "swa_array", "no_swa")}
    assert len(set(runs.values())) == 4
