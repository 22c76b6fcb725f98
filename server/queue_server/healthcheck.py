"""`python -m queue_server.healthcheck`: exit 0 when the server answers SERVING, else 1.

For container healthchecks and scripts: it asks the standard gRPC health service, so it
needs no token and no knowledge of the datasets.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m queue_server.healthcheck", description=__doc__)
    p.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT or unix:PATH")
    p.add_argument(
        "--service", default="", help="a service name, such as batchqueue.v1.BatchQueue/NAME"
    )
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
