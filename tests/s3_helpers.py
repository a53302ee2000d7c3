"""A real S3 API on loopback for the tests (moto's server mode), started and stopped by them."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def loopback_s3(*buckets: str, reads: list | None = None):
    """Yield s3fs options for a fresh S3 API server on 127.0.0.1 with ``buckets`` created.
    With ``reads`` (a list), every object read appends its (key path, body bytes sent)."""
    from moto.server import ThreadedMotoServer

    from pipelines import storage

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    if reads is not None:
        server._server.app = _counting_reads(server._server.app, reads)
    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
                   "region": "us-east-1"}
        for bucket in buckets:  # s3fs mkdir sends a location constraint this server refuses for us-east-1
            fs, _ = storage.filesystem(f"s3://{bucket}", options)
            fs.call_s3("create_bucket", Bucket=bucket)
        yield options
    finally:
        server.stop()


def _counting_reads(app, reads: list):
    """WSGI middleware: record the bytes of every GET response body, by path."""

    def counted(environ, start_response):
        body = app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET":
            return body
        chunks = [bytes(c) for c in body]
        reads.append((environ["PATH_INFO"], sum(len(c) for c in chunks)))
        return chunks

    return counted
