#!/usr/bin/env python3
"""Checks that every file includes only what its layer may include (docs/design.md, "Layers and
folders"). Run by the test suite (ctest `layers`); prints each violation with the file, the line
and the rule, and exits 1 if there is any.

Layers, by folder (an include path is spelled from include/ or src/):
  include/mok/           the public API: only other public headers (mok/, not mok/testing/)
  include/mok/testing/   the fixtures' headers: public and fixture headers
  src/kernels/           device code: other device code and public headers, no host runtime
  src/api/               the API's implementation: public headers, api/, device layouts
  src/reference/         the CPU reference: public headers and its own files
  src/layer/             the single-GPU runtime: api/, kernels/, layer/ and public headers
  src/comm/              the expert-parallel runtime: the single-GPU runtime's and comm/
  src/testing/           the fixtures: anything of the product, no tests or tools
  tools/                 front ends: public and fixture headers only (mok/, mok/testing/)
  python/binding/        the Python extension mok._C, a front end: public headers only (no
                         fixture: the product's package does not contain the fixtures)
Tests may include anything. No product file includes a fixture (mok/testing/, testing/).
The single-GPU runtime also has no preprocessor conditional: its modes are chosen at run time,
once (layer/token_exchange.h, layer/expert_engine.h), and the NCCL guard lives in the build.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
CONDITIONAL = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif)\b")
NO_CONDITIONALS = ("src/layer/",)
SOURCES = (".h", ".cuh", ".cpp", ".cu")

PUBLIC = ("mok/",)
FIXTURES = ("mok/testing/", "testing/")
DEVICE = ("kernels/",)

# folder -> (allowed include prefixes, forbidden prefixes checked first, why)
RULES = [
    ("include/mok/testing/", PUBLIC, (), "fixture headers include public and fixture headers"),
    ("include/mok/", PUBLIC, FIXTURES, "the public API includes only public headers"),
    ("src/kernels/", DEVICE + PUBLIC, FIXTURES, "device code includes no host runtime"),
    (
        "src/api/",
        ("api/",) + DEVICE + PUBLIC,
        FIXTURES,
        "the API's implementation includes no runtime",
    ),
    (
        "src/reference/",
        ("reference/",) + PUBLIC,
        FIXTURES + DEVICE,
        "the CPU reference includes public headers and its own files",
    ),
    (
        "src/layer/",
        ("api/", "layer/") + DEVICE + PUBLIC,
        FIXTURES,
        "the single-GPU runtime includes no fixture and no expert-parallel runtime",
    ),
    (
        "src/comm/",
        ("api/", "layer/", "comm/") + DEVICE + PUBLIC,
        FIXTURES,
        "the expert-parallel runtime includes no fixture",
    ),
    (
        "src/testing/",
        ("api/", "layer/", "comm/", "reference/", "testing/") + DEVICE + PUBLIC,
        (),
        "fixtures include the product, never tests or tools",
    ),
    ("tools/", PUBLIC, (), "front ends include only public headers (mok/, mok/testing/)"),
    (
        "python/binding/",
        PUBLIC,
        FIXTURES,
        "the Python extension includes only the product's public headers",
    ),
]


def rule_for(path):
    for folder, allowed, forbidden, why in RULES:
        if path.startswith(folder):
            return folder, allowed, forbidden, why
    return None


def allowed_include(path, name, allowed, forbidden):
    if any(name.startswith(prefix) for prefix in forbidden):
        return False
    if "/" not in name:
        # A file of the same folder (the reference's and the CLI's own headers).
        return os.path.exists(os.path.join(ROOT, os.path.dirname(path), name))
    return any(name.startswith(prefix) for prefix in allowed)


def main():
    violations = []
    checked = 0
    for top in ("include", "src", "tools", "python/binding"):
        for directory, _, files in os.walk(os.path.join(ROOT, top)):
            for file in sorted(files):
                if not file.endswith(SOURCES):
                    continue
                path = os.path.relpath(os.path.join(directory, file), ROOT)
                rule = rule_for(path)
                if rule is None:
                    violations.append(f"{path}: in no layer's folder (scripts/check_layers.py)")
                    continue
                folder, allowed, forbidden, why = rule
                checked += 1
                with open(os.path.join(ROOT, path), encoding="utf-8") as source:
                    for number, line in enumerate(source, 1):
                        match = INCLUDE.match(line)
                        if match and not allowed_include(path, match.group(1), allowed, forbidden):
                            violations.append(
                                f'{path}:{number}: includes "{match.group(1)}"; {folder}: {why}'
                            )
                        if path.startswith(NO_CONDITIONALS) and CONDITIONAL.match(line):
                            violations.append(
                                f"{path}:{number}: a preprocessor conditional; {folder}: the modes "
                                "are chosen at run time, the NCCL guard lives in the build"
                            )
    for violation in violations:
        print(violation)
    print(f"check_layers: {checked} files, {len(violations)} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
