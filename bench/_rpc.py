"""llama.cpp's own RPC backend over the same kind of delayed links as ours: the
anchor of ``bench/wan.py --rpc`` (docs/ring.md, "The anchor beside us").

    python bench/_rpc.py build [VERSION]   # build (or find) the cached binaries, print their paths

``build()``: ggml's RPC server (``ggml-rpc-server`` in this llama.cpp,
tools/rpc) and ``llama-bench``, built with ``-DGGML_RPC=ON`` from the
llama.cpp vendored in the sdist of the llama-cpp-python our engine links
(the pinned version), CPU only, Release, static. Kept under
``<cache>/llama-rpc/<version>/`` (``<cache>``: models.cache_dir(), by
default ~/.cache/meshnet-p2p) with a stamp written last: a later run with
the same version and flags reuses them; a failed build leaves no stamp (and
its log, ``build.log``, beside where the binaries would be). Needs network
once (pip downloads the sdist), cmake and a C++17 compiler; 5-10 minutes on 2
cores. Any failure raises: ``--rpc`` never skips silently.

``measure()``: one RPC server per span of ours, each listening on loopback
and reached only through its own port of a ``Links`` forwarder (the same
delayed link as our peers'), driven by ``llama-bench --rpc``: one client
that holds the graph and moves every activation itself (a star).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib.metadata
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

PACKAGE = "llama-cpp-python"
SERVER, BENCH = "ggml-rpc-server", "llama-bench"  # the targets' names in this llama.cpp (tools/rpc, tools/llama-bench)
# llama-cpp-python builds its libllama with llama.cpp's defaults (native CPU flags, OpenMP, Release):
# the same here, plus RPC, static binaries (the cache holds two files, not a build tree) and nothing that
# needs a library CI may lack (no HTTPS downloads). LLAMA_CURL is gone from this llama.cpp (a deprecation
# warning if given); LLAMA_OPENSSL is what replaced it.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
STAMP = "stamp.json"


class RpcError(RuntimeError):
    """The anchor could not be built or run; --rpc fails with it instead of skipping."""


def version() -> str:
    """The installed llama-cpp-python's version: the llama.cpp our engine runs on."""
    return importlib.metadata.version(PACKAGE)


def cache_folder(ver: str) -> str:
    from meshnet_p2p.engine.models import cache_dir
    return os.path.join(cache_dir(), "llama-rpc", ver)


def expected_stamp(ver: str) -> dict:
    """What a stamp must say for its binaries to be reused."""
    return {"version": ver, "cmake_flags": list(CMAKE_FLAGS), "binaries": [SERVER, BENCH]}


def cached(folder: str, expected: dict) -> dict[str, str] | None:
    """The binaries' paths if ``folder`` holds a finished build matching ``expected``, else None.

    A stamp is written only after the binaries were copied and ran, so a missing,
    unreadable or different stamp, or a binary gone since, means: build again.
    """
    try:
        with open(os.path.join(folder, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or any(stamp.get(k) != v for k, v in expected.items()):
        return None
    paths = {name: os.path.join(folder, "bin", name) for name in expected["binaries"]}
    if not all(os.path.isfile(p) and os.access(p, os.X_OK) for p in paths.values()):
        return None
    return paths


def write_stamp(folder: str, stamp: dict) -> None:
    tmp = os.path.join(folder, STAMP + ".partial")
    with open(tmp, "w") as f:
        json.dump(stamp, f, indent=1)
    os.replace(tmp, os.path.join(folder, STAMP))  # all or nothing


def build(ver: str | None = None, log=sys.stderr) -> dict[str, str]:
    """The paths of ``ggml-rpc-server`` and ``llama-bench``, built once per version (see the module)."""
    ver = ver or version()
    folder = cache_folder(ver)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    expected = expected_stamp(ver)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once: one builds, the other then finds it
        paths = cached(folder, expected)
        if paths is not None:
            return paths
        shutil.rmtree(folder, ignore_errors=True)  # what an earlier failed build left
        os.makedirs(os.path.join(folder, "bin"))
        started = time.monotonic()
        print(f"bench/_rpc.py: building llama.cpp's {SERVER} and {BENCH} from {PACKAGE}=={ver}'s sdist "
              f"into {folder} (once; 5-10 min on 2 cores)", file=log, flush=True)
        build_log = os.path.join(folder, "build.log")
        with tempfile.TemporaryDirectory(prefix="meshnet-llama-rpc-") as work, open(build_log, "w") as out:
            def run(*cmd: str) -> None:
                out.write(f"$ {' '.join(cmd)}\n")
                out.flush()
                try:
                    subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   check=True)
                except (OSError, subprocess.CalledProcessError) as e:
                    out.flush()
                    with open(build_log) as f:
                        tail = "".join(f.readlines()[-30:])
                    raise RpcError(f"building the RPC anchor failed: {e}\n(log: {build_log})\n{tail}") from e

            run(sys.executable, "-m", "pip", "download", f"{PACKAGE}=={ver}", "--no-deps", "--no-binary", ":all:",
                "-d", work)
            sdists = glob.glob(os.path.join(work, "*.tar.gz"))
            if len(sdists) != 1:
                raise RpcError(f"pip download left {sdists!r} in {work}, not one sdist")
            with tarfile.open(sdists[0]) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(work, filter="data")
                else:  # Python < 3.11.4 (Debian 12's is 3.11.2) has no filters; this sdist came from PyPI just now
                    tar.extractall(work)
            sources = glob.glob(os.path.join(work, "*", "vendor", "llama.cpp", "CMakeLists.txt"))
            if len(sources) != 1:
                raise RpcError(f"no vendor/llama.cpp in {sdists[0]}")
            src, tree = os.path.dirname(sources[0]), os.path.join(work, "build")
            nice = ("nice", "-n", "19") if shutil.which("nice") else ()  # the build is not what is measured
            run(*nice, "cmake", "-S", src, "-B", tree, *CMAKE_FLAGS)
            run(*nice, "cmake", "--build", tree, "--target", SERVER, BENCH, "-j", str(min(os.cpu_count() or 1, 4)))
            paths = {}
            for name in (SERVER, BENCH):
                built = os.path.join(tree, "bin", name)
                paths[name] = os.path.join(folder, "bin", name)
                shutil.copy2(built, paths[name])
            run(paths[SERVER], "--help")  # they start: every library they need is on this machine
            run(paths[BENCH], "--list-devices")
        write_stamp(folder, {**expected, "built": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "build_seconds": round(time.monotonic() - started)})
        print(f"bench/_rpc.py: built in {time.monotonic() - started:.0f} s", file=log, flush=True)
        return paths


def tensor_split(spans: tuple[str, ...]) -> str:
    """llama-bench's ``-ts`` that puts layers on the RPC servers as ``spans`` put them on our peers.

    llama.cpp (src/llama-model.cpp, load_tensors) gives layer il of n (the output layer counts as
    layer n, one more) to the first device whose cumulative share exceeds il / (n + 1): with shares
    proportional to the spans' sizes, the output layer's one added to the last, the boundaries fall
    exactly on ours (0:10,10:20,20:30 -> 10/10/11: layers 0-9, 10-19, 20-29 and the output).
    """
    sizes = [int(b) - int(a) for a, b in (s.split(":") for s in spans)]
    sizes[-1] += 1
    return "/".join(map(str, sizes))


def parse_split(log: str) -> dict[str, dict]:
    """Where llama.cpp put the model, from llama-bench -v's log: per device (by its endpoint when its
    ``using device RPCk (HOST:PORT)`` line names one), in order of its first layer, its ``layers`` (from
    ``load_tensors: layer  N assigned to device RPCk``; layer n is the output) and its weights' ``mib``
    (``RPC0[HOST:PORT] model buffer size = X MiB``)."""
    endpoints: dict[str, str] = {}
    where: dict[int, str] = {}  # a model loaded twice says it twice
    mib: dict[str, float] = {}
    for line in log.splitlines():
        if ": using device " in line:
            name, _, rest = line.split(": using device ", 1)[1].partition(" (")
            endpoints[name] = rest.partition(")")[0]
        head, sep, dev = line.partition(" assigned to device ")
        if sep and "layer" in head:
            where[int(head.rsplit("layer", 1)[1])] = dev.split(",")[0].strip()
        head, sep, size = line.partition(" model buffer size = ")
        if sep and "[" in head:
            mib[head.rsplit("[", 1)[1].rstrip("]")] = float(size.split()[0])
    split: dict[str, dict] = {}
    for layer in sorted(where):
        dev = endpoints.get(where[layer], where[layer])
        split.setdefault(dev, {"layers": [], "mib": mib.get(dev)})["layers"].append(layer)
    return split


def spans_of(split: dict[str, dict], n_layer: int) -> list[str]:
    """``parse_split``'s layers as spans (``start:end``; ``+output`` where layer n_layer, the output, is)."""
    out = []
    for dev in split.values():
        body = [l for l in dev["layers"] if l < n_layer]
        if body and body != list(range(body[0], body[-1] + 1)):
            raise RpcError(f"layers not contiguous on one device: {body}")
        span = f"{body[0]}:{body[-1] + 1}" if body else ""
        out.append(span + ("+output" if n_layer in dev["layers"] else ""))
    return out


def parse_bench(text: str, tokens: int) -> dict:
    """llama-bench ``-o json``'s generation test of ``tokens``: decode tokens/s (the median of its
    repetitions, as ours are medians) and every repetition's."""
    try:
        tests = json.loads(text)
    except ValueError as e:
        raise RpcError(f"llama-bench printed no JSON: {text[-500:]!r}") from e
    gen = [t for t in tests if t.get("n_gen") == tokens and t.get("n_prompt") == 0]
    if len(gen) != 1:
        raise RpcError(f"llama-bench printed {len(gen)} generation tests of {tokens} tokens, not one")
    samples = [float(x) for x in gen[0]["samples_ts"]]
    return {"tok_s": statistics.median(samples), "samples_tok_s": samples, "n_depth": gen[0].get("n_depth")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(p: subprocess.Popen, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RpcError(f"{p.args[0]} exited ({p.returncode}) before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()  # it serves one client at a time:
            return  # this probe's, which sends nothing, ends at once
        except OSError:
            time.sleep(0.1)
    raise RpcError(f"{p.args[0]} did not listen on {port} in {timeout:.0f} s")


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure(paths: dict[str, str], links, model: str, spans: tuple[str, ...], n_layer: int, *, threads: int,
            tokens: int, reps: int, depth: int, timeout: float = 1800) -> dict:
    """llama-bench's decode tokens/s over ``len(spans)`` RPC servers, each behind its own port of
    ``links`` (a bench/wan.py Links: the forwarder with ``listen``/``target``), and where the layers
    fell. Every process started here is stopped before it returns or raises; ``links`` is the caller's."""
    servers: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="meshnet-rpc-") as tmp, contextlib.ExitStack() as stack:
        stack.callback(lambda: [_stop(p) for p in servers])
        endpoints = []
        for i, _ in enumerate(spans):
            port = _free_port()
            log = stack.enter_context(open(os.path.join(tmp, f"server{i}.log"), "w"))
            servers.append(subprocess.Popen([paths[SERVER], "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
            _wait_listening(servers[-1], port)
            link = links.listen()
            links.target(link, "127.0.0.1", port)
            endpoints.append(f"127.0.0.1:{link}")  # reachable only through its delayed link
        cmd = [paths[BENCH], "-m", model, "--rpc", ",".join(endpoints), "-ngl", "99", "-ts", tensor_split(spans),
               "-p", "0", "-n", str(tokens), "-d", str(depth), "-r", str(reps), "-t", str(threads), "-o", "json",
               "-v"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise RpcError(f"llama-bench took more than {timeout:.0f} s") from e
        if done.returncode != 0:
            raise RpcError(f"llama-bench failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
        result = parse_bench(done.stdout, tokens)
        split = parse_split(done.stderr)
        fell = spans_of(split, n_layer)
        if list(split) != endpoints or fell != [*spans[:-1], spans[-1] + "+output"]:
            raise RpcError(f"the layers did not fall on the {len(spans)} RPC servers as on ours ({spans}): "
                           f"{fell} on {list(split)} (servers {endpoints})")
        result["split"] = [f"{span} {dev['mib']} MiB" for span, dev in zip(fell, split.values())]
        result["command"] = " ".join(os.path.basename(c) if c in paths.values() else c for c in cmd)
        for p in servers:
            if p.poll() is not None:
                raise RpcError(f"{p.args[0]} exited ({p.returncode}) during the run")
        return result


if __name__ == "__main__":
    if sys.argv[1:2] != ["build"] or len(sys.argv) > 3:
        sys.exit(__doc__)
    print(json.dumps(build(*sys.argv[2:]), indent=1))
