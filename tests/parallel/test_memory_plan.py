"""Memory plans checked against figures computed by hand from the configs."""

import dataclasses

import pytest

from orca_jax.config import ConfigError, ParallelConfig, load_model_preset
from orca_jax.model.decoder import abstract_decoder
from orca_jax.parallel import mesh
from orca_jax.parallel.memory_plan import (DEFAULT_MEMORY_UTILIZATION, HOST_KV_CEILING, _flat_params, param_shapes,
                                          plan_memory)

GiB = 1 << 30


def test_one_layer_shortcut_matches_the_full_abstract_decoder():
    for name in ("tiny", "tiny-gpt"):
        for tied in (True, False):
            model = dataclasses.replace(load_model_preset(name), n_layers=3, tie_word_embeddings=tied)
            assert sorted(param_shapes(model)) == sorted(_flat_params(abstract_decoder(model)))


def test_gpt3_13b_fits_one_40gib_device():
    model = load_model_preset("gpt3-13b")
    plan = plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB)
    # ~12.85e9 parameters x 2 bytes (bf16) = 25.7e9 bytes, all on the one device.
    assert plan.param_bytes == pytest.approx(model.num_params() * 2, rel=0.01)
    assert plan.param_bytes == pytest.approx(25.7e9, rel=0.01)
    # 40 layers x K,V x 16 tokens x 40 heads x 128 x 2 bytes = 12.5 MiB per page.
    assert plan.kv_bytes_per_page == 40 * 2 * 16 * 40 * 128 * 2 == 12.5 * 2**20
    assert plan.reserve_bytes == 40 * GiB - int(40 * GiB * DEFAULT_MEMORY_UTILIZATION) == int(0.1 * 40 * GiB)
    assert plan.num_pages == (40 * GiB - plan.reserve_bytes - plan.param_bytes) // plan.kv_bytes_per_page
    assert plan.num_tokens == plan.num_pages * 16
    assert plan.num_full_sequences == plan.num_pages // (2048 // 16) >= 7
    assert f"{plan.num_pages} pages" in plan.summary() and f"{plan.num_tokens} tokens" in plan.one_line()


def test_gpt3_175b_fits_tp8_pp2_on_40gib_devices(monkeypatch):
    # The tensor-parallel table the runner is moving to: the vocabulary is split over tp too.
    monkeypatch.setitem(mesh.LOGICAL_AXIS_RULES, "vocab", "tp")
    model = load_model_preset("gpt3-175b")
    d, v, tp = model.d_model, model.vocab_size, 8
    plan = plan_memory(model, ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=2),
                       page_size=16, device_memory=40 * GiB)
    assert [s.layers for s in plan.stages] == [range(0, 48), range(48, 96)]
    # Per layer: kernels (4 d^2 attention + 8 d^2 MLP) and the q/k/v and up biases (3d + 4d) split
    # over tp; the o and down biases and two LayerNorms (6d) replicated. The first stage, the
    # largest, adds its 1/tp of the (tied) embedding and the whole position table.
    layer = (12 * d * d + 7 * d) // tp + 6 * d
    first_stage = 48 * layer + v * d // tp + model.max_position * d
    assert plan.param_bytes == plan.stages[0].param_bytes == 2 * first_stage
    assert plan.stages[1].param_bytes == 2 * (48 * layer + v * d // tp + 2 * d)
    # Against 175e9 / 16 devices: the replicated parts (position table, norms, biases) and the tied
    # head that both ends hold add 0.6%, inside a 1% tolerance.
    assert plan.param_bytes == pytest.approx(2 * model.num_params() / 16, rel=0.01)
    # 48 layers x K,V x 16 tokens x 96/8 heads x 128 x 2 bytes = 4.5 MiB per page.
    assert plan.kv_bytes_per_page == 48 * 2 * 16 * 12 * 128 * 2
    assert plan.num_pages == (40 * GiB - plan.reserve_bytes - plan.param_bytes) // plan.kv_bytes_per_page
    assert plan.num_full_sequences >= 20


def test_the_plan_follows_the_rules_table(monkeypatch):
    model = load_model_preset("smollm2-135m-instruct")
    parallel = ParallelConfig(tensor_parallel_size=3)
    monkeypatch.setitem(mesh.LOGICAL_AXIS_RULES, "vocab", None)
    replicated = plan_memory(model, parallel, page_size=16, kv_cache_memory=GiB).param_bytes
    monkeypatch.setitem(mesh.LOGICAL_AXIS_RULES, "vocab", "tp")
    split = plan_memory(model, parallel, page_size=16, kv_cache_memory=GiB).param_bytes
    embedding = model.vocab_size * model.d_model * 4
    assert replicated - split == embedding - embedding // 3


def test_gpt3_175b_on_one_40gib_device_is_refused_naming_the_shortfall():
    model = load_model_preset("gpt3-175b")
    with pytest.raises(ConfigError) as err:
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB)
    message = str(err.value)
    # ~349 GB of bf16 parameters + a 4 GiB reserve on a 40 GiB device: ~289 GiB short.
    short = (2 * model.num_params() + 4 * GiB - 40 * GiB) / GiB
    assert f"short by {short:.2f} GiB per device" in message
    assert "tensor_parallel_size" in message and "pipeline_parallel_size" in message


def test_tiny_at_tp2_splits_kv_heads_and_tp4_is_refused():
    model = load_model_preset("tiny")  # 2 layers, 2 KV heads, head_dim 16, float32
    plan = plan_memory(model, ParallelConfig(tensor_parallel_size=2), page_size=16, kv_cache_memory=2**20)
    assert plan.kv_heads == 2
    assert plan.kv_bytes_per_page == 2 * 2 * 16 * 1 * 16 * 4
    assert plan.num_pages == 2**20 // plan.kv_bytes_per_page == 256
    with pytest.raises(ConfigError, match="vocab_size=66.*tp 1 or 2"):
        plan_memory(model, ParallelConfig(tensor_parallel_size=4), page_size=16, kv_cache_memory=2**20)


def test_smollm2_tp2_is_refused_naming_1_or_3():
    model = load_model_preset("smollm2-135m-instruct")
    with pytest.raises(ConfigError, match="tp 1 or 3"):
        plan_memory(model, ParallelConfig(tensor_parallel_size=2), page_size=16, kv_cache_memory=GiB)


def test_replicated_kv_heads_cost_what_native_ones_do():
    gqa = dataclasses.replace(load_model_preset("tiny"), vocab_size=64, n_heads=8, n_kv_heads=2, head_dim=8,
                              bos_token_id=None, eos_token_id=None)
    parallel = ParallelConfig(tensor_parallel_size=4)
    replicated = plan_memory(gqa, parallel, page_size=16, kv_cache_memory=2**20)
    native = plan_memory(dataclasses.replace(gqa, n_kv_heads=4), parallel, page_size=16, kv_cache_memory=2**20)
    assert replicated.kv_heads == 4
    assert replicated.stages == native.stages


def test_one_device_plan_counts_pages_by_hand():
    model = load_model_preset("smollm2-135m-instruct")
    plan = plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=GiB)
    page_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers x (K, V) x tokens x KV heads x head_dim x float32
    assert plan.kv_bytes_per_page == page_bytes and plan.num_pages == GiB // page_bytes == 1456
    assert plan.param_bytes == model.num_params() * 4


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_hold_every_parameter_once_except_a_tied_head(tied):
    model = dataclasses.replace(load_model_preset("tiny-gpt"), n_layers=3, tie_word_embeddings=tied)
    plan = plan_memory(model, ParallelConfig(pipeline_parallel_size=2), page_size=16, kv_cache_memory=2**20)
    assert [s.layers for s in plan.stages] == [range(0, 2), range(2, 3)]
    duplicated_head = model.vocab_size * model.d_model * 4 if tied else 0
    assert sum(s.param_bytes for s in plan.stages) == model.num_params() * 4 + duplicated_head
    assert [s.kv_bytes_per_page for s in plan.stages] == [n * 2 * 16 * 4 * 16 * 4 for n in (2, 1)]


def test_kv_that_cannot_hold_one_sequence_of_a_given_max_model_len_is_refused():
    model = load_model_preset("gpt3-13b")
    refusal = (r"holds 128 tokens per device \(kv_cache_memory=100.00 MiB\), less than one sequence of "
               r"max_model_len=2048; short by 1.46 GiB per device. Lower max_model_len to 128 or less, or give the "
               r"KV cache more memory \(raise kv_cache_memory\)")
    with pytest.raises(ConfigError, match=refusal):
        plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=100 * 2**20, max_model_len=2048)
    # A shorter context fits the same 100 MiB: 8 pages x 16 tokens.
    plan = plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=100 * 2**20, max_model_len=128)
    assert plan.num_pages == 8 and plan.num_full_sequences == 1 and plan.lowered_from is None


def test_a_context_that_does_not_fit_is_lowered_when_max_model_len_is_not_given():
    model = load_model_preset("gpt3-13b")  # trained for 2048 tokens
    plan = plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=100 * 2**20 + 5 * 2**20)
    assert (plan.num_pages, plan.max_model_len, plan.lowered_from) == (8, 128, 2048)  # whole pages: 8 x 16
    assert plan.lowered_note() in plan.summary()
    assert "max_model_len lowered from gpt3-13b's context length 2048 to 128 tokens" in plan.lowered_note()
    # Not even one page: nothing to lower to.
    nothing = r"holds 0 tokens per device .* max_model_len=2048; .* Lower max_model_len, or give"
    with pytest.raises(ConfigError, match=nothing):
        plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=2**20)
    # A context that fits is kept.
    assert plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=2 * GiB).lowered_from is None


def test_kv_memory_beside_parameters_must_fit_the_device():
    model = load_model_preset("gpt3-13b")
    with pytest.raises(ConfigError, match="short by .* GiB per device; lower kv_cache_memory to 12.06 GiB"):
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, kv_cache_memory=20 * GiB)


def test_bad_requests_are_refused():
    tiny = load_model_preset("tiny")
    with pytest.raises(ConfigError, match="exceeds 'tiny'.s context length 128"):
        plan_memory(tiny, ParallelConfig(), page_size=16, max_model_len=129, kv_cache_memory=2**20)
    with pytest.raises(ConfigError, match="give device_memory .*, kv_cache_memory .* or host_memory"):
        plan_memory(tiny, ParallelConfig(), page_size=16)


def test_dtype_override_halves_float32_parameters():
    tiny = load_model_preset("tiny")
    f32 = plan_memory(tiny, ParallelConfig(), page_size=16, kv_cache_memory=2**20)
    bf16 = plan_memory(tiny, ParallelConfig(), page_size=16, kv_cache_memory=2**20, dtype="bfloat16")
    assert bf16.dtype == "bfloat16" and 2 * bf16.param_bytes == f32.param_bytes
    assert 2 * bf16.kv_bytes_per_page == f32.kv_bytes_per_page


def test_the_kv_pages_follow_the_memory_utilization_and_a_shortfall_names_it():
    model = load_model_preset("gpt3-13b")  # 23.9 GiB of bf16 parameters on one device
    plans = {f: plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, memory_utilization=f)
             for f in (0.7, 0.9, 0.95)}
    for f, plan in plans.items():
        usable = int(40 * GiB * f)
        assert plan.reserve_bytes == 40 * GiB - usable
        assert plan.num_pages == (usable - plan.param_bytes) // plan.kv_bytes_per_page
        assert f"of {f:g} x 40.00 GiB per device" in plan.one_line()
    assert plans[0.7].num_pages < plans[0.9].num_pages < plans[0.95].num_pages
    with pytest.raises(ConfigError, match=r"memory utilization 0.5: parameters need 23.9\d GiB per device plus a "
                                          r"20.00 GiB reserve, short by 3.9\d GiB per device.*raise the memory"):
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, memory_utilization=0.5)
    with pytest.raises(ConfigError, match="must be in"):
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, memory_utilization=1.5)


def tiny_page_and_params(**plan_args) -> tuple[int, int]:
    """The tiny model's KV bytes per page and parameter bytes per device (page_size 16)."""
    plan = plan_memory(load_model_preset("tiny"), ParallelConfig(**plan_args), page_size=16, kv_cache_memory=2**20)
    return plan.kv_bytes_per_page, plan.param_bytes


@pytest.mark.parametrize("utilization", [0.5, 0.9])
def test_on_cpu_the_kv_budget_is_the_utilization_of_the_free_host_memory_after_the_parameters(utilization):
    tiny = load_model_preset("tiny")
    page, params = tiny_page_and_params()
    free = 3 * 2**20
    plan = plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=free, memory_utilization=utilization)
    assert plan.num_pages == int((free - params) * utilization) // page
    assert plan.host_memory == free and plan.capped_at_seqs is None
    assert f"of {utilization:g} x (3.00 MiB free host memory - parameters)" in plan.one_line()
    # The layout's devices share the host: each stage's budget is its share less its own parameters.
    two_stages = plan_memory(tiny, ParallelConfig(pipeline_parallel_size=2), page_size=16, host_memory=free,
                             memory_utilization=utilization)
    assert two_stages.num_pages == min(int((free // 2 - s.param_bytes) * utilization) // s.kv_bytes_per_page
                                       for s in two_stages.stages)
    assert "3.00 MiB free host memory / 2 devices" in two_stages.one_line()


def test_a_given_kv_cache_memory_wins_over_the_host_memory():
    plan = plan_memory(load_model_preset("tiny"), ParallelConfig(), page_size=16, kv_cache_memory=2**20,
                       host_memory=GiB)
    assert plan.num_pages == 2**20 // plan.kv_bytes_per_page == 128 and plan.host_memory is None


def test_the_cpu_budget_is_capped_at_max_num_seqs_sequences_of_max_model_len():
    tiny = load_model_preset("tiny")  # 128 tokens: 8 pages of 16
    plan = plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=GiB, max_num_seqs=3)
    assert (plan.num_pages, plan.capped_at_seqs, plan.num_full_sequences) == (3 * 8, 3, 3)
    assert "3 x 128-token sequences, capped at max_num_seqs=3)" in plan.one_line()
    assert plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=GiB, max_num_seqs=3,
                       max_model_len=40).num_pages == 3 * 3  # 40 tokens take 3 pages
    # A draft model's pages come out of the same budget, as many as the target's: the cap is the same count.
    page, _ = tiny_page_and_params()
    with_draft = plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=GiB, max_num_seqs=3,
                             draft_kv_bytes_per_page=page)
    assert with_draft.num_pages == 3 * 8 and with_draft.kv_bytes == 2 * plan.kv_bytes
    # Below the cap the budget sets the count: 80 pages, fewer than 32 sequences take.
    below = plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=2**20, max_num_seqs=32)
    assert below.capped_at_seqs is None and below.num_pages == int((2**20 - below.param_bytes) * 0.9) // page == 80


def test_on_cpu_a_context_that_does_not_fit_is_lowered_and_a_given_one_refused():
    tiny = load_model_preset("tiny")
    page, params = tiny_page_and_params()
    free = params + int(5.5 * page / 0.9)  # 0.9 of what the parameters leave: 5 whole pages
    plan = plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=free, max_num_seqs=32)
    assert (plan.num_pages, plan.max_model_len, plan.lowered_from) == (5, 80, 128)
    refusal = (r"tiny on tp 1 x pp 1: the KV cache holds 80 tokens per device \(0.9 x \(.* free host memory - "
               r"parameters\)\), less than one sequence of max_model_len=128; short by 20.00 KiB per device. Lower "
               r"max_model_len to 80 or less, or give the KV cache more memory \(free memory on the host")
    with pytest.raises(ConfigError, match=refusal):
        plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=free, max_num_seqs=32, max_model_len=128)


def test_parameters_beyond_the_free_host_memory_are_refused():
    tiny = load_model_preset("tiny")
    _, params = tiny_page_and_params()
    with pytest.raises(ConfigError, match=r"tiny \(float32\) does not fit this host's free memory on tp 1 x pp 1: "
                                          r"parameters need .* per device, .* short by 1.00 KiB; free memory"):
        plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=params - 1024)


def test_the_cpu_budget_stops_at_4_gib_unless_one_sequence_needs_more():
    tiny = load_model_preset("tiny")
    page, _ = tiny_page_and_params()
    plan = plan_memory(tiny, ParallelConfig(), page_size=16, host_memory=1 << 40)
    assert plan.num_pages == HOST_KV_CEILING // page and plan.kv_ceiling == HOST_KV_CEILING
    assert "capped at 4.00 GiB (--kv-cache-memory takes more)" in plan.one_line()
    # A context longer than the ceiling holds still gets one whole sequence, if the host has it.
    long = dataclasses.replace(load_model_preset("llama-3-8b"), max_position=65536)  # 8 GiB of bfloat16 KV a sequence
    plan = plan_memory(long, ParallelConfig(), page_size=16, host_memory=1 << 40)
    assert (plan.max_model_len, plan.num_full_sequences, plan.lowered_from) == (65536, 1, None)
    assert plan.kv_bytes == 8 << 30
    # A given kv_cache_memory is not capped.
    assert plan_memory(tiny, ParallelConfig(), page_size=16, kv_cache_memory=8 << 30).num_pages == (8 << 30) // page
