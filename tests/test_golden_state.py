"""Behaviour pinned across refactors: the `.upc` bytes and the decoded cache of fixed documents.

Written before Upcycle was reshaped into packages (issue 12) and left unchanged by it: a tiny Llama
and a tiny Qwen2 compress one fixed document at three settings (exact, ratio 4, ratio 8) with the
per-layer codec, the ratios also with the batched codec run on the CPU, and one state clustered by
the default clause tagger. The test records the sha256 of the state's bytes and of the prefix
`load_prefix` rebuilds from it.

The state's bytes are hashed as stored, except three header fields that name the moment and the
machine rather than the state: ``created_at`` (the timestamp), ``model.spec`` (the tiny model's
temporary folder) and ``kite_version``. They are replaced by fixed values and the header is
serialized as the writer does (compact JSON, UTF-8). The container is parsed here with the
documented layout (docs/upc-format.md), not with KITE's reader, so the test does not move with it.

Floating-point results depend on the thread count and the CPU's instruction set; the test runs on
one thread, and keeps, for each kind of CPU it was recorded on, one table for the native runtime (as
`make test` builds it) and one for the pure-torch fallbacks (KITE_RUNTIME=torch, or no compiler). A
run passes when its digests are one recorded CPU's.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from tests.tiny_models import CORPUS

VOLATILE = {"created_at": "2026-01-01T00:00:00+00:00", "kite_version": "0", "model.spec": "tiny"}
DOCUMENT = CORPUS.replace(". ", ".\n\n", 5)
SETTINGS = ("exact", "ratio=4", "ratio=8")

# The CPU the digests were recorded on -> kernels ('native': build/libkite_runtime.so, 'torch': its
# fallbacks) -> 'arch/setting/codec path/tagging' -> (sha256 of the normalized .upc bytes, sha256 of the
# decoded prefix). A run must match one recorded CPU's pair. A CPU of another kind (torch's capability
# and MKL pick other kernels; the native runtime is built with -march=native) gets different bits for
# the same code: record its table on a commit whose tables pass elsewhere (the head and that commit
# must print the same lines) and add it here, named by what `_cpu()` prints.
GOLDEN = {
    # recorded before 2026-12 on the CPU CI and the dev box then had (its capability not noted)
    "before 2026-12": {
        "native": {
            'llama/exact/layer/plain': ('08dcd59a6f9aaac0a3a69ccdd947039119c802adcb25d59f421abcc3ae02cf70', 'eb3b667643b1ea94a11826664ff20b3f92d9882233aec03dfbff7ebb76bd72e1'),
            'llama/ratio=4/layer/plain': ('84eabd9036441c61e0b29aa902f7bd5397d2bdfe554467f0f90d177659ff0a4c', '98ba1202cc3ea4f868db777a2211543186614ce596c39a346c51447d03b5f76c'),
            'llama/ratio=8/layer/plain': ('5616bfb28c5fa9f49c37623b143a176f992b7c2a09c2992c7825d568591ccc05', '9fc69e2630beede4de92f108ee4415a3682c6ae7273dcf79626af8910bef2646'),
            'qwen2/exact/layer/plain': ('f3a7c154ec2b3d29fe21cca761af9348b8603196a39ebfe0fcbb9b5a3dd20b99', 'bb43373e0c08766290a9f5973e2f540cbdb1c5ea3cdb96d99e68ef0c50b99452'),
            'qwen2/ratio=4/layer/plain': ('033d5671a1fbdc76df57729593462bd840e9f342136ac43b33df26b8e9ddbfe6', 'cf1d508232bf1272f0b6bee2d7acb8735ded630339a85c9cb95bf6572814cb42'),
            'qwen2/ratio=8/layer/plain': ('03703e7a81df13c7979e4217b8ab505bfe600ba830f449018d37e5f1ee3e15cc', 'ae5a97a0250a66387b0dff68e21a24a006a4d375aef9862a39b324014f065890'),
            'llama/ratio=4/batched/plain': ('84eabd9036441c61e0b29aa902f7bd5397d2bdfe554467f0f90d177659ff0a4c', '98ba1202cc3ea4f868db777a2211543186614ce596c39a346c51447d03b5f76c'),
            'llama/ratio=8/batched/plain': ('5616bfb28c5fa9f49c37623b143a176f992b7c2a09c2992c7825d568591ccc05', '9fc69e2630beede4de92f108ee4415a3682c6ae7273dcf79626af8910bef2646'),
            'qwen2/ratio=4/batched/plain': ('033d5671a1fbdc76df57729593462bd840e9f342136ac43b33df26b8e9ddbfe6', 'cf1d508232bf1272f0b6bee2d7acb8735ded630339a85c9cb95bf6572814cb42'),
            'qwen2/ratio=8/batched/plain': ('03703e7a81df13c7979e4217b8ab505bfe600ba830f449018d37e5f1ee3e15cc', 'ae5a97a0250a66387b0dff68e21a24a006a4d375aef9862a39b324014f065890'),
            'llama/ratio=4/layer/tagged': ('fbf56476a845796478e3e36bb6bc65e87337a5310c4bfb02d0ef314e66fc1ef3', 'd7dcc363c569fbd26eeb96cb0bfe2c385ccff950a20a003cd4c416f226cf619e'),
        },
        "torch": {
            'llama/exact/layer/plain': ('08dcd59a6f9aaac0a3a69ccdd947039119c802adcb25d59f421abcc3ae02cf70', 'eb3b667643b1ea94a11826664ff20b3f92d9882233aec03dfbff7ebb76bd72e1'),
            'llama/ratio=4/layer/plain': ('21a40c588098873c7bc690365fb9148fdcbd12ddb3d38e0009f0e326a7368d51', '0c14df816bb3a6f004cb5f9946f3b3336b1a924bc212e0db40a3536fdff7ba24'),
            'llama/ratio=8/layer/plain': ('d639ea3c8671e1cd7d3c5281c64e39e26bb114033ecac3570f1485b066997e4f', 'b8cd09b101ede1f4bab93fb748a922cd4e56cad0b7c85d9e5cdf562cb98574e6'),
            'qwen2/exact/layer/plain': ('f3a7c154ec2b3d29fe21cca761af9348b8603196a39ebfe0fcbb9b5a3dd20b99', 'bb43373e0c08766290a9f5973e2f540cbdb1c5ea3cdb96d99e68ef0c50b99452'),
            'qwen2/ratio=4/layer/plain': ('7387cee816795a91ea7087cf5424af95425d865a683f6a26c3879f35519a0729', 'f12c7482239c2c0b2fc9654311b427807551a0b18a3afd67ccd21fa9efd79ef9'),
            'qwen2/ratio=8/layer/plain': ('7d774e5df25235484c45c510d711e3cd77faa6c1a92d323339c23daeff9dfd09', '72b3b670ec61b54a03c24f24d4d81a55f0650ac5c5be65ec8375a52376cb28e5'),
            'llama/ratio=4/batched/plain': ('21a40c588098873c7bc690365fb9148fdcbd12ddb3d38e0009f0e326a7368d51', '0c14df816bb3a6f004cb5f9946f3b3336b1a924bc212e0db40a3536fdff7ba24'),
            'llama/ratio=8/batched/plain': ('d639ea3c8671e1cd7d3c5281c64e39e26bb114033ecac3570f1485b066997e4f', 'b8cd09b101ede1f4bab93fb748a922cd4e56cad0b7c85d9e5cdf562cb98574e6'),
            'qwen2/ratio=4/batched/plain': ('7387cee816795a91ea7087cf5424af95425d865a683f6a26c3879f35519a0729', 'f12c7482239c2c0b2fc9654311b427807551a0b18a3afd67ccd21fa9efd79ef9'),
            'qwen2/ratio=8/batched/plain': ('7d774e5df25235484c45c510d711e3cd77faa6c1a92d323339c23daeff9dfd09', '72b3b670ec61b54a03c24f24d4d81a55f0650ac5c5be65ec8375a52376cb28e5'),
            'llama/ratio=4/layer/tagged': ('3bd8b80d71ef6e3ff58ffc54f16eba2a3c47b82769ac36af21614719c5858f05', 'c25fed701e69e641e525dcae9633d959515f37f623f0c6d5d92ecb22e665dcb6'),
        },
    },
    # recorded 2026-12-01 on the Xeon CI and the dev box now have; session 10's
    # commit 0d4d4ee prints the same 22 lines here, so only the CPU moved
    "AVX512 amx_bf16 avx512_bf16 avx512_fp16": {
        "native": {
            'llama/exact/layer/plain': ('aa27d3ef22a38a3977cfbba1ae27083c6f566ab5eb79ab4540206484ce10fe1e', 'b743f010535b46801a1380f87ff971fbb9d66e6a22b21b41d491db1f2dd68a3d'),
            'llama/ratio=4/batched/plain': ('84eabd9036441c61e0b29aa902f7bd5397d2bdfe554467f0f90d177659ff0a4c', '98ba1202cc3ea4f868db777a2211543186614ce596c39a346c51447d03b5f76c'),
            'llama/ratio=4/layer/plain': ('84eabd9036441c61e0b29aa902f7bd5397d2bdfe554467f0f90d177659ff0a4c', '98ba1202cc3ea4f868db777a2211543186614ce596c39a346c51447d03b5f76c'),
            'llama/ratio=4/layer/tagged': ('fbf56476a845796478e3e36bb6bc65e87337a5310c4bfb02d0ef314e66fc1ef3', 'd7dcc363c569fbd26eeb96cb0bfe2c385ccff950a20a003cd4c416f226cf619e'),
            'llama/ratio=8/batched/plain': ('5616bfb28c5fa9f49c37623b143a176f992b7c2a09c2992c7825d568591ccc05', '9fc69e2630beede4de92f108ee4415a3682c6ae7273dcf79626af8910bef2646'),
            'llama/ratio=8/layer/plain': ('5616bfb28c5fa9f49c37623b143a176f992b7c2a09c2992c7825d568591ccc05', '9fc69e2630beede4de92f108ee4415a3682c6ae7273dcf79626af8910bef2646'),
            'qwen2/exact/layer/plain': ('2d5a8533b0f3a1b1fee5738a40c661479a232e946b25face662d863852cd662c', 'cdccadac8116958cb0f2d69d6d4a2acde408f1d1fa3c7e4b6b02306cf3e4ce95'),
            'qwen2/ratio=4/batched/plain': ('033d5671a1fbdc76df57729593462bd840e9f342136ac43b33df26b8e9ddbfe6', 'cf1d508232bf1272f0b6bee2d7acb8735ded630339a85c9cb95bf6572814cb42'),
            'qwen2/ratio=4/layer/plain': ('033d5671a1fbdc76df57729593462bd840e9f342136ac43b33df26b8e9ddbfe6', 'cf1d508232bf1272f0b6bee2d7acb8735ded630339a85c9cb95bf6572814cb42'),
            'qwen2/ratio=8/batched/plain': ('5b2adce928de65128ebcffb077047a96bfecbae5c0118f438fb337ef19a852b3', '9b8f8e33a6030d39f6eb0afa6983ded9d27d941fa0e61f4a6b1e714717545e7a'),
            'qwen2/ratio=8/layer/plain': ('5b2adce928de65128ebcffb077047a96bfecbae5c0118f438fb337ef19a852b3', '9b8f8e33a6030d39f6eb0afa6983ded9d27d941fa0e61f4a6b1e714717545e7a'),
        },
        "torch": {
            'llama/exact/layer/plain': ('aa27d3ef22a38a3977cfbba1ae27083c6f566ab5eb79ab4540206484ce10fe1e', 'b743f010535b46801a1380f87ff971fbb9d66e6a22b21b41d491db1f2dd68a3d'),
            'llama/ratio=4/batched/plain': ('21a40c588098873c7bc690365fb9148fdcbd12ddb3d38e0009f0e326a7368d51', '0c14df816bb3a6f004cb5f9946f3b3336b1a924bc212e0db40a3536fdff7ba24'),
            'llama/ratio=4/layer/plain': ('21a40c588098873c7bc690365fb9148fdcbd12ddb3d38e0009f0e326a7368d51', '0c14df816bb3a6f004cb5f9946f3b3336b1a924bc212e0db40a3536fdff7ba24'),
            'llama/ratio=4/layer/tagged': ('3bd8b80d71ef6e3ff58ffc54f16eba2a3c47b82769ac36af21614719c5858f05', 'c25fed701e69e641e525dcae9633d959515f37f623f0c6d5d92ecb22e665dcb6'),
            'llama/ratio=8/batched/plain': ('d639ea3c8671e1cd7d3c5281c64e39e26bb114033ecac3570f1485b066997e4f', 'b8cd09b101ede1f4bab93fb748a922cd4e56cad0b7c85d9e5cdf562cb98574e6'),
            'llama/ratio=8/layer/plain': ('d639ea3c8671e1cd7d3c5281c64e39e26bb114033ecac3570f1485b066997e4f', 'b8cd09b101ede1f4bab93fb748a922cd4e56cad0b7c85d9e5cdf562cb98574e6'),
            'qwen2/exact/layer/plain': ('2d5a8533b0f3a1b1fee5738a40c661479a232e946b25face662d863852cd662c', 'cdccadac8116958cb0f2d69d6d4a2acde408f1d1fa3c7e4b6b02306cf3e4ce95'),
            'qwen2/ratio=4/batched/plain': ('7387cee816795a91ea7087cf5424af95425d865a683f6a26c3879f35519a0729', 'f12c7482239c2c0b2fc9654311b427807551a0b18a3afd67ccd21fa9efd79ef9'),
            'qwen2/ratio=4/layer/plain': ('7387cee816795a91ea7087cf5424af95425d865a683f6a26c3879f35519a0729', 'f12c7482239c2c0b2fc9654311b427807551a0b18a3afd67ccd21fa9efd79ef9'),
            'qwen2/ratio=8/batched/plain': ('7d774e5df25235484c45c510d711e3cd77faa6c1a92d323339c23daeff9dfd09', '72b3b670ec61b54a03c24f24d4d81a55f0650ac5c5be65ec8375a52376cb28e5'),
            'qwen2/ratio=8/layer/plain': ('7d774e5df25235484c45c510d711e3cd77faa6c1a92d323339c23daeff9dfd09', '72b3b670ec61b54a03c24f24d4d81a55f0650ac5c5be65ec8375a52376cb28e5'),
        },
    },
}


def _normalized_state_digest(path) -> str:
    data = path.read_bytes()
    pre = struct.Struct("<8sHHI16s")
    magic, version, flags, hlen, _ = pre.unpack_from(data)
    assert magic == b"KITEUPC\0"
    meta = json.loads(data[pre.size:pre.size + hlen])
    for dotted, value in VOLATILE.items():
        node = meta
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        assert leaf in node, f"header field {dotted} is gone"
        node[leaf] = value
    header = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
    h = hashlib.sha256()
    h.update(struct.pack("<8sHHI", magic, version, flags, len(header)))
    h.update(header)
    h.update(data[pre.size + hlen:])
    return h.hexdigest()


def _prefix_digest(prefix) -> str:
    h = hashlib.sha256()
    for t in list(prefix.keys) + list(prefix.values):
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    h.update(str(prefix.next_position).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def golden_models(tiny_models):
    from kite.model import load_model

    return {arch: load_model(str(tiny_models[arch]), device="cpu") for arch in ("llama", "qwen2")}


# (arch, setting, codec path, tagged): "layer" = the per-layer codec (compress_document's default
# with a model on the CPU), "batched" = the batched codec (the GPU's) run on the CPU
CASES = ([(arch, setting, "layer", False) for arch in ("llama", "qwen2") for setting in SETTINGS]
         + [(arch, setting, "batched", False) for arch in ("llama", "qwen2") for setting in SETTINGS[1:]]
         + [("llama", "ratio=4", "layer", True)])


@pytest.mark.parametrize("arch,setting,path,tagged", CASES,
                         ids=[f"{a}-{s}-{p}{'-tagged' if t else ''}" for a, s, p, t in CASES])
def test_state_bytes_and_decoded_cache_do_not_move(golden_models, arch, setting, path, tagged, tmp_path,
                                                   one_thread, request):
    from kite.upcycle import CompressSettings, codec_settings, compress_document, load_prefix

    lm = golden_models[arch]
    tagger = None
    if tagged:
        from kite.upcycle import build_tagger, load_upcycle_config

        tagger = build_tagger(lm, *load_upcycle_config(None))
    out = tmp_path / "golden.upc"
    settings = CompressSettings(codec=codec_settings(setting), n_clusters=3, min_span_tokens=8,
                                max_span_tokens=24)
    compress_document(lm, DOCUMENT, out, settings, tagger=tagger, source_name="golden.txt",
                      device="cpu" if path == "batched" else None)
    prefix, _ = load_prefix(out, lm)
    got = (_normalized_state_digest(out), _prefix_digest(prefix))
    key = f"{arch}/{setting}/{path}/{'tagged' if tagged else 'plain'}"
    if request.config.getoption("--record-golden", default=False):
        print(f"GOLDEN {key!r}: {got!r},")
        return
    from kite.kernels import native

    kernels = "native" if native.cpu() is not None else "torch"
    wants = {cpu: tables[kernels][key] for cpu, tables in GOLDEN.items() if key in tables[kernels]}
    assert wants, f"no golden digests for {key}: run pytest --record-golden and paste the lines"
    if got in wants.values():
        return
    where = f"(this CPU: {_cpu()}; tables recorded on: {', '.join(wants)})"
    assert got[0] in {w[0] for w in wants.values()}, f"{key}: the .upc bytes moved {where}"
    raise AssertionError(f"{key}: the decoded cache moved {where}")


def _cpu() -> str:
    """What names a CPU's table: torch's kernel capability and the AVX-512 extensions that change
    fp16 / bf16 arithmetic."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    extras = sorted(f for f in flags if f in ("avx512_fp16", "avx512_bf16", "amx_bf16", "amx_fp16"))
    return " ".join([torch.backends.cpu.get_cpu_capability(), *extras])
