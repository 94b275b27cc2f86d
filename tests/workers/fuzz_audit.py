"""Fuzzing `tfmixprec audit FILE` (tests/checks/test_audit.py): mutated `.keras` and `.h5`
files, each audited in this one process through the command's own code
(`tfmixprec.tools.cli.main`).

Run in a folder that holds packages named like trusted ones (`keras_cv/`, `keras_nlp/`) and an
`evil/` package, each of which writes a marker file when imported: the mutations name their
modules, and none may ever run. For each file it records the exit code, the seconds it took,
and anything that escaped the command (a traceback); at the end, the process's peak memory.
Writes fuzz.json to --out.

    python tests/workers/fuzz_audit.py --out DIR --files 200 --seed 0
"""

import argparse
import contextlib
import io
import json
import os
import random
import resource
import time
import traceback
import zipfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import h5py  # noqa: E402
import keras  # noqa: E402

import tfmixprec  # noqa: E402
from tfmixprec.tools import cli  # noqa: E402

PACKAGES = ("keras_cv", "keras_nlp", "evil")  # each writes <name>.ran when imported


def plant_packages(folder: Path) -> None:
    for name in PACKAGES:
        (folder / name).mkdir(exist_ok=True)
        (folder / name / "__init__.py").write_text(
            f"open({str(folder / (name + '.ran'))!r}, 'w').close()\n"
        )


def seeds(folder: Path) -> tuple[bytes, bytes]:
    """A valid .keras and .h5 file of a small float16 model, as bytes."""
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, name="hidden"),
                keras.layers.Dense(3, activation="softmax", name="probs"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.save(folder / "seed.keras")
    model.save(folder / "seed.h5")
    return (folder / "seed.keras").read_bytes(), (folder / "seed.h5").read_bytes()


# ------------------------------------------------------------------ mutations
def flip_bits(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 16)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    return bytes(data)


def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))]


def mutate_json(rng: random.Random, node, depth=0):
    """A structural mutation of a JSON value: keys dropped, values swapped for odd ones, class
    and module names that mean code, deeper nesting."""
    odd = [
        None,
        3,
        -1,
        1e308,
        "",
        "x" * 1000,
        [],
        {},
        [[[[]]]],
        True,
        {"class_name": "__lambda__", "config": {"code": "4wAAAA=="}},
        {"class_name": "Foo", "module": "evil.layers", "config": {"name": "f"}},
        {"class_name": "Foo", "module": "keras_cv.layers", "config": {"name": "g"}},
        {"class_name": "Foo", "module": "keras_nlp.models", "config": {"name": "h"}},
        {"class_name": "function", "module": "evil", "config": "run"},
    ]
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        roll = rng.random()
        if roll < 0.2:
            node.pop(key)
        elif roll < 0.5:
            node[key] = rng.choice(odd)
        elif roll < 0.6:
            node[key] = {"config": node[key], "class_name": "Wrapper", "module": "evil"}
        else:
            node[key] = mutate_json(rng, node[key], depth + 1)
    elif isinstance(node, list) and node:
        i = rng.randrange(len(node))
        node[i] = mutate_json(rng, node[i], depth + 1) if rng.random() < 0.7 else rng.choice(odd)
    elif rng.random() < 0.5:
        return rng.choice(odd)
    return node


def rezip(rng: random.Random, data: bytes) -> bytes:
    """The archive's members, re-packed with some dropped, duplicated, renamed, replaced or
    added, and the config mutated."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = [(name, archive.read(name)) for name in archive.namelist()]
    out = []
    for name, body in members:
        roll = rng.random()
        if name == "config.json" and roll < 0.7:
            config = json.loads(body)
            for _ in range(rng.randint(1, 4)):
                config = mutate_json(rng, config)
            out.append((name, json.dumps(config).encode()))
        elif roll < 0.1:
            continue  # dropped
        elif roll < 0.2:
            out += [(name, body), (name, flip_bits(rng, body))]  # duplicated
        elif roll < 0.3:
            out.append((name + rng.choice(["~", "/x", ".bak", ""]), body))
        elif roll < 0.4:
            out.append((name, truncate(rng, body) if body else body))
        else:
            out.append((name, body))
    if rng.random() < 0.3:
        out.append((rng.choice(["../escape.json", "/abs.json", "a/" * 50 + "deep", ""]), b"{}"))
    buffer = io.BytesIO()
    method = rng.choice([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, body in out:
            with contextlib.suppress(ValueError):  # an empty name, say
                archive.writestr(name or "unnamed", body)
    return buffer.getvalue()


def mutate_h5_config(rng: random.Random, data: bytes, folder: Path) -> bytes:
    path = folder / "work.h5"
    path.write_bytes(data)
    with h5py.File(path, "r+") as file:
        for attr in ("model_config", "training_config"):
            if attr in file.attrs and rng.random() < 0.7:
                value = json.loads(file.attrs[attr])
                for _ in range(rng.randint(1, 4)):
                    value = mutate_json(rng, value)
                file.attrs[attr] = json.dumps(value)
    return path.read_bytes()


def mutations(rng: random.Random, keras_file: bytes, h5_file: bytes, n: int, folder: Path):
    for i in range(n):
        if i % 5 == 4:  # a fifth are .h5 files
            kind = rng.choice(["flip", "truncate", "config"])
            if kind == "config":
                yield f"{i}.h5", mutate_h5_config(rng, h5_file, folder)
            else:
                yield f"{i}.h5", (flip_bits if kind == "flip" else truncate)(rng, h5_file)
            continue
        kind = rng.choice(["flip", "truncate", "rezip", "rezip", "rezip"])
        data = {"flip": flip_bits, "truncate": truncate, "rezip": rezip}[kind](rng, keras_file)
        yield f"{i}.keras", data


def audit(path: Path) -> tuple[int | None, str | None]:
    """The command's exit code, or what escaped it (never expected)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return cli.main(["audit", str(path)]), None
        except SystemExit as exit_:
            return exit_.code, None
        except BaseException:  # noqa: BLE001  (recorded: the test fails on any)
            return None, traceback.format_exc()[-2000:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = Path.cwd()
    plant_packages(folder)
    keras_file, h5_file = seeds(folder)
    rng = random.Random(args.seed)
    results = []
    for name, data in mutations(rng, keras_file, h5_file, args.files, folder):
        path = folder / f"fuzz-{name}"
        path.write_bytes(data)
        start = time.perf_counter()
        code, escaped = audit(path)
        results.append(
            {"file": name, "code": code, "seconds": time.perf_counter() - start, "escaped": escaped}
        )
        path.unlink()
    ran = [name for name in PACKAGES if (folder / f"{name}.ran").exists()]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(Path(args.out) / "fuzz.json", "w") as f:
        json.dump({"results": results, "ran": ran, "peak_mib": peak}, f)


if __name__ == "__main__":
    main()
