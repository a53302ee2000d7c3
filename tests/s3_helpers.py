"""A real S3 API on loopback for the tests (moto's server mode), started and stopped by them."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def loopback_s3(*buckets: str):
    """Yield s3fs options for a fresh S3 API server on 127.0.0.1 with ``buckets`` created."""
    from moto.server import ThreadedMotoServer

    from pipelines import storage

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
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
