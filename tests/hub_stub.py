"""A local stand-in for the Hugging Face Hub, for tests: the real Hub is unreachable from them.

It serves just what huggingface_hub 2.4 asks of the Hub to push a model and to download it, and keeps every repo in
memory so tests can look at what arrived:

- ``POST /api/repos/create``: new repos start with one commit holding ``.gitattributes``, as on the Hub;
- ``POST /api/models/{repo}/branch/{branch}``;
- ``POST /api/validate-yaml``: a README.md's front matter must be a YAML mapping;
- ``POST /api/models/{repo}/preupload/{revision}``: decides per file "regular" (sent base64 inside the commit) or
  "lfs" (``*.safetensors`` and friends, binary or large files, as the Hub's default .gitattributes does);
- ``POST /{repo}.git/info/lfs/objects/batch``, ``PUT`` upload and ``POST`` verify: the git-LFS "basic" transfer;
- ``POST /api/models/{repo}/commit/{revision}``: the NDJSON commit (header, file, lfsFile, deletedFile lines);
- ``GET /api/models/{repo}[/revision/{revision}]`` (model_info) and ``HEAD``/``GET /{repo}/resolve/{revision}/{path}``
  with the headers hf_hub_download relies on (X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size) and the Hub's
  error codes (X-Error-Code: RepoNotFound, RevisionNotFound, EntryNotFound).

Tokens map to user names; a repo belongs to its namespace's user. Private repos answer 401 RepoNotFound to anyone
else, like the Hub. Every request is logged with its method, path and user.

Pointing huggingface_hub at it takes more than ``HF_ENDPOINT``: huggingface_hub reads its environment once, at
import, into ``huggingface_hub.constants`` (ENDPOINT, HUGGINGFACE_CO_URL_TEMPLATE, HF_HUB_OFFLINE,
HF_HUB_DISABLE_XET, ...), and HfApi objects copy the endpoint when built (transformers caches one). In a test
process that has already imported it, use [`use_hub`] and [`go_offline`]; a fresh process only needs the
environment variables (``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET=1``, ``HF_HUB_OFFLINE=1``).

Uploads use the git-LFS protocol: with ``hf_xet`` installed huggingface_hub would upload through Xet storage (a
separate content-addressed service spoken to by a Rust client), which this stand-in does not implement; the Hub
still accepts LFS uploads from clients without Xet, and ``HF_HUB_DISABLE_XET`` makes huggingface_hub one of them.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.onnx", "*.msgpack", "*.gguf",
                "*.npz", "*.pkl", "*.zip", "*.tar.gz")
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


@dataclass
class StoredFile:
    content: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        """sha256 for LFS files, the git blob sha1 for the others (what the Hub reports as ETag)."""
        if self.lfs:
            return hashlib.sha256(self.content).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    description: str
    files: dict[str, StoredFile]
    changed: list[str]  # paths added or replaced by this commit


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # "main", "v2", "refs/pr/1" -> commit oid
    lfs_objects: dict[str, bytes] = field(default_factory=dict)  # uploaded, not yet necessarily committed

    @property
    def owner(self) -> str:
        return self.repo_id.split("/")[0]

    def resolve(self, revision: str) -> Commit | None:
        oid = self.refs.get(revision, revision)
        return self.commits.get(oid)

    def files(self, revision: str = "main") -> dict[str, bytes]:
        commit = self.resolve(revision)
        if commit is None:
            raise KeyError(f"{self.repo_id} has no revision {revision!r}")
        return {path: f.content for path, f in commit.files.items()}


@dataclass
class LoggedRequest:
    method: str
    path: str
    user: str | None  # resolved from the bearer token; None without one
    authorization: str | None


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.extra = extra or {}  # more fields of the JSON body


class HubStub:
    """A threaded HTTP server on 127.0.0.1 (a free port) standing in for the Hub.

    ``with HubStub({"hf_token": "alice"}) as hub:`` starts it; ``hub.url`` is the endpoint, ``hub.repos`` the repos
    by id, ``hub.requests`` the request log.
    """

    def __init__(self, tokens: dict[str, str]):
        self.tokens = dict(tokens)
        self.repos: dict[str, Repo] = {}
        self.requests: list[LoggedRequest] = []
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubStub":
        stub = self

        class Handler(_Handler):
            hub = stub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None

    def __enter__(self) -> "HubStub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- repository state ---------------------------------------------------------------------------------------
    def create_repo(self, repo_id: str, private: bool) -> Repo:
        repo = Repo(repo_id, private)
        self._commit(repo, None, "main", "initial commit", "", {".gitattributes": StoredFile(GITATTRIBUTES, False)})
        self.repos[repo_id] = repo
        return repo

    def _commit(self, repo: Repo, parent: Commit | None, ref: str, message: str, description: str,
                changes: dict[str, StoredFile | None]) -> Commit:
        files = dict(parent.files) if parent else {}
        for path, stored in changes.items():
            if stored is None:
                files = {p: f for p, f in files.items() if p != path and not p.startswith(path.rstrip("/") + "/")}
            else:
                files[path] = stored
        digest = hashlib.sha1(json.dumps([parent.oid if parent else None, message, len(repo.commits),
                                          sorted((p, f.oid) for p, f in files.items())]).encode())
        commit = Commit(digest.hexdigest(), parent.oid if parent else None, message, description, files,
                        [p for p, f in changes.items() if f is not None])
        repo.commits[commit.oid] = commit
        repo.refs[ref] = commit.oid
        return commit

    def user_of(self, authorization: str | None) -> str | None:
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.tokens[token]

    def readable(self, repo_id: str, user: str | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and user != repo.owner):
            # the Hub does not tell a private repo from a missing one
            raise HubError(401 if user is None else 404, "Repository not found", "RepoNotFound")
        return repo

    def writable(self, repo_id: str, user: str | None) -> Repo:
        repo = self.readable(repo_id, user)
        if user != repo.owner:
            raise HubError(403 if user else 401, f"You don't have the rights to write to {repo_id}")
        return repo


def _is_lfs(path: str, size: int, sample: bytes) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS) or size >= LFS_MIN_SIZE or b"\0" in sample


_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES = [  # (method, path pattern, handler name)
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", rf"/api/models/{_REPO}/branch/(?P<branch>[^/]+)", "create_branch"),
    ("POST", rf"/api/models/{_REPO}/preupload/(?P<revision>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{_REPO}/commit/(?P<revision>[^/]+)", "commit"),
    ("GET", rf"/api/models/{_REPO}(?:/revision/(?P<revision>[^/]+))?", "model_info"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("PUT", rf"/_lfs/{_REPO}/(?P<oid>[0-9a-f]{{64}})", "lfs_upload"),
    ("POST", rf"/_lfs/{_REPO}/(?P<oid>[0-9a-f]{{64}})/verify", "lfs_verify"),
    ("GET", rf"/{_REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
    ("HEAD", rf"/{_REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects
    hub: HubStub

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        body = self._body()
        auth = self.headers.get("Authorization")
        try:
            user = self.hub.user_of(auth)
        except HubError as error:
            user = None
            self._log(method, url.path, user, auth)
            return self._error(error)
        self._log(method, url.path, user, auth)
        for route_method, pattern, name in _ROUTES:
            match = re.fullmatch(pattern, url.path)
            if route_method == method and match:
                args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                try:
                    with self.hub.lock:
                        status, headers, payload = getattr(self, name)(user, body, parse_qs(url.query), **args)
                except HubError as error:
                    return self._error(error)
                return self._send(status, headers, payload, method)
        self._error(HubError(404, f"the Hub stand-in does not implement {method} {url.path}"))

    def _log(self, method, path, user, auth):
        with self.hub.lock:
            self.hub.requests.append(LoggedRequest(method, path, user, auth))

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size)
                self.rfile.readline()  # CRLF after each chunk
                if size == 0:
                    break
                chunks.append(chunk)
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _send(self, status: int, headers: dict, payload, method: str) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        headers = {"Content-Type": "application/json", **headers}
        for key, value in headers.items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    def _error(self, error: HubError) -> None:
        headers = dict(error.headers, **{"X-Error-Message": error.message})
        if error.code:
            headers["X-Error-Code"] = error.code
        self._send(error.status, headers, {"error": error.message, **error.extra}, self.command)

    # -- endpoints: each returns (status, headers, JSON-able payload or bytes) ----------------------------------
    def create_repo(self, user, body, query):
        if user is None:
            raise HubError(401, "You must be authenticated to create a repo")
        spec = json.loads(body)
        if spec.get("type", "model") != "model":
            raise HubError(400, "the Hub stand-in only hosts model repos")
        namespace = spec.get("organization") or user
        if namespace != user:
            raise HubError(403, f"You don't have the rights to create a repo under {namespace}")
        repo_id = f"{namespace}/{spec['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:  # huggingface_hub reads the url from this answer too (exist_ok=True)
            raise HubError(409, "You already created this model repo", extra={"url": url})
        private = spec.get("visibility", "private" if spec.get("private") else "public") == "private"
        self.hub.create_repo(repo_id, private)
        return 200, {}, {"url": url, "name": repo_id, "id": repo_id}

    def validate_yaml(self, user, body, query):
        content = json.loads(body)["content"]
        match = re.match(r"---\n(.*?)\n---\n", content, re.S)
        if match is None:
            return 200, {}, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]}
        try:
            meta = yaml.safe_load(match.group(1))
        except yaml.YAMLError as error:
            return 400, {}, {"errors": [{"message": f"invalid YAML: {error}"}]}
        if not isinstance(meta, dict):
            return 400, {}, {"errors": [{"message": "the metadata must be a YAML mapping"}]}
        bad = [k for k in ("tags",) if k in meta and not isinstance(meta[k], list)]
        if bad:
            return 400, {}, {"errors": [{"message": f"'{k}' must be a list"} for k in bad]}
        return 200, {}, {"errors": [], "warnings": []}

    def whoami(self, user, body, query):
        if user is None:
            raise HubError(401, "Invalid user token")
        return 200, {}, {"type": "user", "name": user, "orgs": []}

    def create_branch(self, user, body, query, repo, branch):
        r = self.hub.writable(repo, user)
        if branch in r.refs:
            raise HubError(409, f"Branch {branch} already exists")
        start = (json.loads(body) if body else {}).get("startingPoint") or "main"
        commit = r.resolve(start)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {start}", "RevisionNotFound")
        r.refs[branch] = commit.oid
        return 200, {}, {}

    def _revision(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def preupload(self, user, body, query, repo, revision):
        r = self.hub.writable(repo, user)
        commit = self._revision(r, revision)
        files = []
        for f in json.loads(body)["files"]:
            lfs = _is_lfs(f["path"], f["size"], base64.b64decode(f["sample"]))
            existing = commit.files.get(f["path"])
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": existing.oid if existing else None})
        return 200, {}, {"files": files, "commitOid": commit.oid}

    def lfs_batch(self, user, body, query, repo):
        r = self.hub.writable(repo, user)
        request = json.loads(body)
        if request.get("operation") != "upload":
            raise HubError(400, "the Hub stand-in only takes LFS uploads")
        objects = []
        for obj in request["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in r.lfs_objects:  # no actions = already stored
                href = f"{self.hub.url}/_lfs/{repo}/{obj['oid']}"
                entry["actions"] = {"upload": {"href": href}, "verify": {"href": f"{href}/verify"}}
            objects.append(entry)
        return 200, {"Content-Type": "application/vnd.git-lfs+json"}, {"transfer": "basic", "objects": objects}

    def lfs_upload(self, user, body, query, repo, oid):
        # a pre-signed storage URL on the Hub: no token is sent, the content must match the announced oid
        if repo not in self.hub.repos:
            raise HubError(404, "no such upload")
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "the uploaded content does not match its sha256")
        self.hub.repos[repo].lfs_objects[oid] = body
        return 200, {"ETag": f'"{oid}"'}, b""

    def lfs_verify(self, user, body, query, repo, oid):
        r = self.hub.writable(repo, user)
        expected = json.loads(body)
        stored = r.lfs_objects.get(oid)
        if stored is None or len(stored) != expected["size"]:
            raise HubError(404, f"LFS object {oid} was not uploaded (or has another size)")
        return 200, {}, {}

    def commit(self, user, body, query, repo, revision):
        r = self.hub.writable(repo, user)
        parent = self._revision(r, revision)
        header, changes = None, {}
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
                changes[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                content = r.lfs_objects.get(value["oid"])
                if content is None:
                    raise HubError(422, f"LFS file {value['path']} ({value['oid']}) was never uploaded")
                changes[value["path"]] = StoredFile(content, lfs=True)
            elif key in ("deletedFile", "deletedFolder"):
                changes[value["path"]] = None
            else:
                raise HubError(400, f"unknown commit operation {key!r}")
        if header is None:
            raise HubError(400, "the commit payload has no header line")
        if header.get("parentCommit") not in (None, parent.oid):
            raise HubError(412, "parent commit is not the head of the revision")
        ref = revision
        if query.get("create_pr") == ["1"]:
            ref = f"refs/pr/{1 + sum(name.startswith('refs/pr/') for name in r.refs)}"
        commit = self.hub._commit(r, parent, ref, header["summary"], header.get("description", ""), changes)
        pr_url = f"{self.hub.url}/{repo}/discussions/{ref.rsplit('/', 1)[-1]}" if ref != revision else None
        return 200, {}, {"success": True, "commitOid": commit.oid, "commitUrl": f"{self.hub.url}/{repo}/commit/"
                         f"{commit.oid}", "pullRequestUrl": pr_url}

    def model_info(self, user, body, query, repo, revision="main"):
        r = self.hub.readable(repo, user)
        commit = self._revision(r, revision)
        return 200, {}, {"_id": repo, "id": repo, "modelId": repo, "sha": commit.oid, "private": r.private,
                         "author": r.owner, "tags": [], "siblings": [{"rfilename": p} for p in sorted(commit.files)]}

    def resolve(self, user, body, query, repo, revision, path):
        r = self.hub.readable(repo, user)
        commit = self._revision(r, revision)
        stored = commit.files.get(path)
        if stored is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{stored.oid}"', "Accept-Ranges": "none"}
        if stored.lfs:  # what the Hub adds for LFS files (it then redirects to a CDN; served directly here)
            headers.update({"X-Linked-Etag": f'"{stored.oid}"', "X-Linked-Size": len(stored.content)})
        return 200, dict(headers, **{"Content-Type": "application/octet-stream"}), stored.content


def use_hub(monkeypatch, url: str) -> None:
    """Point huggingface_hub (and transformers) of this process at `url`, with no stored token and no Xet."""
    import huggingface_hub.constants as constants
    import transformers.utils.hub as transformers_hub

    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # upload through LFS (see the module docstring)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(transformers_hub, "_hf_api", None)  # transformers' cached HfApi holds the old endpoint
    # only tokens passed explicitly may reach the stand-in
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/hf-token")
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", "/nonexistent/hf-stored-tokens")


def go_offline(monkeypatch) -> None:
    """HF_HUB_OFFLINE=1 for this process: huggingface_hub read the variable at import into
    ``constants.HF_HUB_OFFLINE``, which transformers and huggingface_hub consult through ``is_offline_mode()``."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
