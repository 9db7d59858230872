"""`python -m zoo.build [--only NAME ...]`: build the zoo folders (all by default) (cached; a warm cache is a no-op).

Prints one line per model (name and folder); the last line is one JSON object {name: folder}.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

from zoo.tiny import ensure_medium_wan, ensure_tiny_flux, ensure_tiny_flux_kontext, ensure_tiny_wan
from zoo.tiny_families import (
    ensure_tiny_hunyuan15,
    ensure_tiny_hunyuan15_i2v,
    ensure_tiny_qwen_image,
    ensure_tiny_qwen_image_edit,
    ensure_tiny_sd3,
    ensure_tiny_zimage,
)
from zoo.wan22 import ensure_tiny_wan21_i2v, ensure_tiny_wan22_a14b, ensure_tiny_wan22_i2v, ensure_tiny_wan22_ti2v

BUILDERS: dict[str, Callable[[], Path]] = {
    "tiny-wan": ensure_tiny_wan,
    "tiny-flux": ensure_tiny_flux,
    "tiny-flux-kontext": ensure_tiny_flux_kontext,
    "medium-wan": ensure_medium_wan,
    "tiny-sd3": ensure_tiny_sd3,
    "tiny-zimage": ensure_tiny_zimage,
    "tiny-qwen-image": ensure_tiny_qwen_image,
    "tiny-qwen-image-edit": ensure_tiny_qwen_image_edit,
    "tiny-hunyuan15": ensure_tiny_hunyuan15,
    "tiny-hunyuan15-i2v": ensure_tiny_hunyuan15_i2v,
    "tiny-wan22-a14b": ensure_tiny_wan22_a14b,
    "tiny-wan22-ti2v": ensure_tiny_wan22_ti2v,
    "tiny-wan22-i2v": ensure_tiny_wan22_i2v,
    "tiny-wan21-i2v": ensure_tiny_wan21_i2v,
}


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(prog="python -m zoo.build", description=__doc__)
    parser.add_argument("--only", nargs="+", choices=sorted(BUILDERS), help="build only these")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = args.only or tuple(BUILDERS)
    built = {}
    for name in names:
        built[name] = str(BUILDERS[name]())
        print(f"{name}: {built[name]}")
    print(json.dumps(built))
    return built


if __name__ == "__main__":
    main()
