"""Every port `tandem serve` opens, from --port (and the number of ingress replicas).

Throughput-optimized Serve (the default) answers HTTP in the ingress replicas themselves
("direct ingress"): replica i listens on ``port + i``, and that is the URL printed, the fast
path. Serve also runs its proxy actor, which balances over the replicas at the cost of a hop:
it listens on ``port + n``. Any gRPC listener an ingress replica opens (tandem configures
none) takes a port in ``port + n + 1 .. port + 2n``. With ``--no-throughput-optimized`` only
the proxy listens, on ``port``. Ray's own processes (GCS, raylet, object store, workers, agents)
take ports Ray picks at random: with a loopback ``--host`` on 127.0.0.1 only (but for Ray
Serve's inter-deployment gRPC server in each Serve replica, which Ray Serve 2.60 binds to every
interface), with another on every interface, as a node of a cluster needs. The dashboard is off
(Ray still runs its API server process, for usage stats alone, without the dashboard's UI).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ServePorts:
    http: tuple[int, ...]  # where clients connect: the ingress replicas' own, or the proxy's
    proxy: int
    grpc: range  # reserved for direct-ingress gRPC listeners

    @property
    def all(self) -> list[int]:
        return sorted({*self.http, self.proxy, *self.grpc})


def serve_ports(port: int, num_ingress_replicas: int, throughput_optimized: bool) -> ServePorts:
    n = num_ingress_replicas
    if not throughput_optimized:
        return ServePorts((port,), port, range(0))
    return ServePorts(tuple(range(port, port + n)), port + n, range(port + n + 1,
                                                                    port + 2 * n + 1))
