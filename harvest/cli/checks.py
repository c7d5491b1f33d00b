"""Inputs checked before a command registers or writes anything: the dataset, the model, the
output, the capture points. Each check fails (one line naming the fix, exit 2) within seconds,
so a retry with other options finds nothing left behind: no `run.json`, no run in Redis.
"""

from __future__ import annotations

import os

from harvest.cli.errors import S3_CREDENTIALS_FIX, redact
from harvest.cli.options import fail


def check_dataset(path: str) -> None:
    """The dataset resolves to readable files (what the producer would find first)."""
    from harvest.producer.sources import DatasetNotFound, dataset_files

    try:
        dataset_files(path)  # any other DatasetError (an InputError) is told as it is
    except DatasetNotFound as e:
        fail(f"{e}: check the DATASET argument (a .jsonl/.parquet/.arrow file, a saved dataset, or a folder of them)")


def looks_local(model: str) -> bool:
    """A model argument meant as a folder on this machine rather than a hub id: it starts with
    ./ ../ / or ~, ends with a separator, or its first component is a folder that exists here
    (`models/tiny2` beside a `models/`); a hub id `org/name` has none of these."""
    if model in (".", "..") or model.startswith(("./", "../", "/", "~")) or model.endswith(os.sep):
        return True
    head = model.split(os.sep, 1)[0]
    return os.sep in model and os.path.exists(head)


HUB_PROBE_S = 4.0  # a hub that does not answer within this is unreachable for the run's purposes


def check_model(model: str | None, local_only: bool = False) -> None:
    """A local model folder exists and holds a config.json; a missing one is named at once and
    never looked up on the hub. A local model also turns the hub off for transformers (here and
    in the processes this one starts). A bare name that is no folder here (`--model tiny`) is a
    hub id: refused at once with `local_only` (the reference engine loads only local folders),
    else the hub is asked about it once, within seconds, where transformers' own lookup of an
    unreachable hub retries for tens of seconds and ends in a multi-line message."""
    if not model:
        return
    path = os.path.expanduser(model)
    if looks_local(model) and not os.path.isdir(path):
        fail(
            f"model folder {model!r} does not exist (a local path, so it is not looked up on the model hub): "
            "check --model"
        )
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            fail(f"model folder {model!r} has no config.json: --model must be a Hugging Face model folder")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return
    if local_only:
        fail(
            f"model {model!r} is not a folder on this machine, and the reference engine loads only local models: "
            "pass --model PATH, a Hugging Face model folder"
        )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        fail(
            f"model {model!r} is not a folder on this machine, and the model hub is off (HF_HUB_OFFLINE): "
            "pass --model PATH, a local Hugging Face model folder"
        )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    answer = _probe_hub(f"{endpoint}/api/models/{model}")
    if answer == 404:
        fail(
            f"model {model!r} is not a folder on this machine, nor a model on the hub ({endpoint}): "
            "pass --model PATH, a local Hugging Face model folder, or the hub id org/name"
        )
    if isinstance(answer, str):
        fail(
            f"model {model!r} is not a folder on this machine, and the model hub ({endpoint}) cannot be reached "
            f"({answer}): pass --model PATH, a local Hugging Face model folder"
        )


def _probe_hub(url: str) -> int | str:
    """The hub's HTTP status for `url`, or why it gave none within HUB_PROBE_S (name resolution
    included: it runs on a thread that is abandoned when late)."""
    import threading
    import urllib.error
    import urllib.request

    result: list[int | str] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=HUB_PROBE_S) as r:
                result.append(r.status)
        except urllib.error.HTTPError as e:
            result.append(e.code)
        except (urllib.error.URLError, OSError, ValueError) as e:
            result.append(str(getattr(e, "reason", e)))

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(HUB_PROBE_S + 0.5)
    return result[0] if result else f"no answer within {HUB_PROBE_S:.0f} s"


def check_output(url: str | None, reach: bool = True) -> None:
    """An object-storage output has credentials in the environment and, with `reach`, is
    reachable with them: one HEAD of its bucket (3 s to connect, no retries) before anything is
    written. A collector checks only the credentials: its storage errors stop it with the shard
    in progress recorded, to be finished once the storage is fixed."""
    if url and "://" in url and not url.startswith(("s3://", "s3a://", "file://")):
        fail(
            f"output {url}: harvest writes to a local folder, file:// or s3:// (S3-compatible stores too: MinIO, "
            "Ceph; --s3-endpoint): its shards are streamed as S3 multipart uploads"
        )
    if not url or not url.startswith(("s3://", "s3a://")):
        return
    import botocore.session
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    from harvest.storage import s3_options

    bucket = url.split("://", 1)[1].split("/", 1)[0]
    opts = s3_options()
    client_kw = dict(opts.get("client_kwargs", {}))
    session = botocore.session.get_session()
    if not opts.get("key") and session.get_credentials() is None:
        fail(f"no S3 credentials for {url}: {S3_CREDENTIALS_FIX}")
    if not reach:
        return
    endpoint = client_kw.get("endpoint_url", "AWS S3")
    try:
        client = session.create_client(
            "s3",
            aws_access_key_id=opts.get("key"),
            aws_secret_access_key=opts.get("secret"),
            aws_session_token=opts.get("token"),
            config=Config(connect_timeout=3, read_timeout=10, retries={"max_attempts": 1}),
            **client_kw,
        )
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        fail(f"no S3 credentials for {url}: {S3_CREDENTIALS_FIX}")
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            fail(
                f"bucket {bucket!r} does not exist at {redact(endpoint)}: create it, or fix --out "
                "(and HARVEST_S3_ENDPOINT / --s3-endpoint)"
            )
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            fail(
                f"S3 at {redact(endpoint)} denied access to bucket {bucket!r} ({code}): check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY and the bucket's policy"
            )
        fail(f"S3 at {redact(endpoint)} answered {code} for bucket {bucket!r}: {e}")
    except BotoCoreError as e:
        fail(f"cannot reach S3 at {redact(endpoint)} for {url} ({e}): check --s3-endpoint / HARVEST_S3_ENDPOINT")


def check_layers(model: str, layers: str) -> None:
    """The capture points fit the model, read from its config.json (before torch is imported)."""
    from harvest.config import model_layers, parse_layers
    from harvest.errors import ConfigurationError

    try:
        n = model_layers(model)
    except ConfigurationError:
        return  # not a plain config.json: the engine resolves the shape itself and says why it cannot
    parse_layers(layers, n)  # a ConfigurationError names the flag and the range
