"""Ray's token authentication, as hvdkit uses it: every cluster hvdkit starts has a token of
its own, and a cluster it joins is joined the way it was started.

Ray 2.60 reads the mode from ``RAY_AUTH_MODE`` (``token`` or ``disabled``) once, at import,
and a token from ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else
``~/.ray/auth_token`` (:data:`SOURCES`, in that order). Two of its defaults bite:

* an embedded ``ray.init()`` turns token mode on and, finding no token, *writes*
  ``~/.ray/auth_token``; from then on the user's own ``ray start --head`` turns
  authentication on by itself (it does when a token exists) while their ``ray start
  --address`` workers do not, and cannot join;
* ``ray start`` never creates a token, so a job script that asks for token mode on a machine
  where no embedded run left that file dies at once.

So :func:`own_cluster_env` gives every cluster hvdkit starts (the embedded instance, the Ray
of an sbatch job, ``local-cluster.sh ray-up``) a fresh random token through the environment,
never through the user's ``~/.ray``; and :func:`join_env` asks the cluster at an address, with
one gRPC call to its GCS, whether it wants a token and whether the one found is its own,
before ``ray.init`` (which would retry for 20 s and print a traceback).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from ..errors import ConfigError

__all__ = ["SOURCES", "find_token", "own_cluster_env", "join_env", "ask_cluster"]

MODE_VAR, TOKEN_VAR, PATH_VAR = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
SOURCES = f"{TOKEN_VAR}, the file {PATH_VAR} names, or ~/.ray/auth_token"
# any cheap GCS call answers UNAUTHENTICATED before anything else when the token is missing or wrong
_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
PROBE_TIMEOUT_S = 10.0


def new_token() -> str:
    """256 random bits, as Ray's own generator makes them."""
    return secrets.token_hex(32)


def own_cluster_env() -> dict[str, str]:
    """The environment of a Ray cluster hvdkit starts: token mode with a token of its own
    (Ray then finds it in the environment and writes no file)."""
    return {MODE_VAR: "token", TOKEN_VAR: new_token()}


def find_token(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The token Ray would use, with where it came from, or None; Ray's order (:data:`SOURCES`).
    A ``RAY_AUTH_TOKEN_PATH`` that cannot be read is an error, as it is for Ray."""
    environ = os.environ if environ is None else environ
    if environ.get(TOKEN_VAR, "").strip():
        return environ[TOKEN_VAR].strip(), TOKEN_VAR
    if environ.get(PATH_VAR):
        path = Path(environ[PATH_VAR])
        try:
            token = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{PATH_VAR}={path} cannot be read ({getattr(exc, 'strerror', None) or exc})",
                              f"point {PATH_VAR} at the cluster's token file, or unset it") from None
        if not token:
            raise ConfigError(f"{PATH_VAR}={path} is empty", f"point {PATH_VAR} at the cluster's token file")
        return token, f"{PATH_VAR}={path}"
    default = Path(environ.get("HOME") or Path.home()) / ".ray" / "auth_token"
    try:
        token = default.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return (token, str(default)) if token else None


def ask_cluster(address: str, token: str | None, timeout: float = PROBE_TIMEOUT_S) -> str:
    """One gRPC call to the GCS at ``address`` with ``token`` (or none): ``"ok"``,
    ``"unauthenticated"`` (a token is wanted, or this one is not the cluster's), or a short
    reason why what answers there is not a Ray GCS."""
    import grpc  # Ray's own dependency

    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(_PROBE_METHOD, request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        call(b"", timeout=timeout, metadata=metadata)
        return "ok"
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return "unauthenticated"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no gRPC answer within {timeout:.0f} s"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return "it speaks gRPC but is no Ray GCS (Ray Client's port?)"
        return f"{code.name.lower()}: {(exc.details() or '').split(';')[0]}"  # type: ignore[attr-defined]
    finally:
        channel.close()


def join_env(address: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """How to join the cluster at ``address`` (which answers TCP): the ``RAY_AUTH_*`` variables
    to set before Ray is imported, or a one-line :class:`ConfigError`.

    ``RAY_AUTH_MODE`` set by the user is kept; otherwise the cluster is asked whether it wants
    a token, and the token found (:func:`find_token`) is checked against it.
    """
    environ = os.environ if environ is None else environ
    mode = environ.get(MODE_VAR, "").strip().lower()
    if mode not in ("", "token", "disabled"):
        raise ConfigError(f"{MODE_VAR}={environ[MODE_VAR]!r} is not a mode Ray knows",
                          f"set {MODE_VAR}=token or {MODE_VAR}=disabled, or unset it: hvdkit then asks the cluster")
    if mode != "token":
        answer = ask_cluster(address, None)
        if answer == "ok":
            return {MODE_VAR: "disabled"}  # the cluster runs without authentication
        _refuse_non_ray(address, answer)
        if mode == "disabled":
            raise ConfigError(f"{MODE_VAR}=disabled, but the Ray cluster at {address} uses token authentication",
                              f"unset {MODE_VAR} and give the cluster's token in {SOURCES}")
    found = find_token(environ)
    if found is None:
        raise ConfigError(f"the Ray cluster at {address} uses token authentication and this shell has no token"
                          if mode != "token" else f"{MODE_VAR}=token, and this shell has no token",
                          f"give the cluster's token in {SOURCES} (the head's 'ray get-auth-token' prints it)")
    token, source = found
    answer = ask_cluster(address, token)
    if answer == "ok":
        return {MODE_VAR: "token"}
    _refuse_non_ray(address, answer)
    raise ConfigError(f"the Ray cluster at {address} refused the token from {source}: it is not this cluster's",
                      f"give the cluster's own token in {SOURCES} (the head's 'ray get-auth-token' prints it)")


def _refuse_non_ray(address: str, answer: str) -> None:
    """One line when what answered is no Ray GCS (anything but "ok" or "unauthenticated")."""
    if answer not in ("ok", "unauthenticated"):
        raise ConfigError(f"what answers at {address} is not a Ray cluster's head ({answer})",
                          "give the address 'ray start --head' printed (host:port of its GCS, 6379 by default)")


if __name__ == "__main__":  # python -m hvdkit.rayrun.auth: a new token (slurm/ray.sbatch, local-cluster.sh)
    print(new_token())
