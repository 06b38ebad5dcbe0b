"""Image bytes from http(s) URLs, for a server that allows it (`--allowed-media-domains`, vLLM's flag).

`MediaFetcher.fetch` is blocking stdlib urllib: call it on a worker thread, never on an event loop. A URL is
fetched only when its host is one of the allowed domains (exactly: vLLM's rule), and every redirect is
checked the same way before it is followed. The whole fetch has a deadline (`timeout_s`, each socket
operation too) and a size bound (`max_bytes`: a larger Content-Length is refused before the body is read,
and the body is read in pieces and refused as soon as it passes the bound). Every failure is an ImageError
whose message names the URL and the reason (the server answers it 400). Proxies come from the
environment, as urllib takes them.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlparse

from tierlm.multimodal.image_processor import ImageError

DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
MAX_IMAGE_BYTES = 64 << 20  # an image file or fetched body larger than this is refused
READ_BYTES = 1 << 16


@dataclass(frozen=True)
class MediaFetcher:
    domains: frozenset[str]  # host names, lower case
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def from_flags(cls, domains: list[str], timeout_s: float = DEFAULT_FETCH_TIMEOUT_S) -> MediaFetcher:
        """From --allowed-media-domains (host names) and the fetch timeout; bad values are ValueErrors."""
        for domain in domains:
            if not domain or "/" in domain or ":" in domain:
                raise ValueError(f"--allowed-media-domains: {domain!r} is not a host name (give e.g. "
                                 "images.example.com, without scheme, port or path)")
        if not timeout_s > 0:
            raise ValueError(f"--image-fetch-timeout must be more than 0 seconds, got {timeout_s}")
        return cls(frozenset(d.lower() for d in domains), float(timeout_s))

    def check(self, url: str, redirected: bool = False) -> None:
        """An ImageError unless `url` is http(s) on an allowed host."""
        parsed = urlparse(url)
        what = "redirected to" if redirected else "URL"
        if parsed.scheme not in ("http", "https"):
            raise ImageError(f"{what} {_short(url)}: only http and https are fetched")
        if (parsed.hostname or "") not in self.domains:
            raise ImageError(f"{what} {_short(url)}: host {parsed.hostname!r} is not in --allowed-media-domains "
                             f"({', '.join(sorted(self.domains))})")

    def fetch(self, url: str) -> bytes:
        """The body at `url` (blocking), or an ImageError saying why not."""
        self.check(url)
        opener = urllib.request.build_opener(_CheckedRedirects(self))
        deadline = time.monotonic() + self.timeout_s
        try:
            with opener.open(url, timeout=self.timeout_s) as response:
                length = response.headers.get("Content-Length", "")
                if length.isdigit() and int(length) > self.max_bytes:
                    raise self._too_large(url)
                body = bytearray()
                while piece := response.read1(READ_BYTES):
                    body += piece
                    if len(body) > self.max_bytes:
                        raise self._too_large(url)
                    if time.monotonic() > deadline:
                        raise TimeoutError
                return bytes(body)
        except urllib.error.HTTPError as exc:
            raise ImageError(f"fetching {_short(url)} failed: HTTP {exc.code} {exc.reason}") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise self._timed_out(url) from None
            raise ImageError(f"fetching {_short(url)} failed: {exc.reason}") from None
        except TimeoutError:
            raise self._timed_out(url) from None
        except (OSError, http.client.HTTPException) as exc:
            raise ImageError(f"fetching {_short(url)} failed: {exc!r}") from None

    def _too_large(self, url: str) -> ImageError:
        return ImageError(f"{_short(url)} is larger than {self.max_bytes:,} bytes")

    def _timed_out(self, url: str) -> ImageError:
        return ImageError(f"fetching {_short(url)} timed out after {self.timeout_s:g} s")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, fetcher: MediaFetcher) -> None:
        super().__init__()
        self.fetcher = fetcher

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.fetcher.check(newurl, redirected=True)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _short(url: str, limit: int = 120) -> str:
    return url if len(url) <= limit else url[:limit] + "..."
