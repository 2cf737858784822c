"""Images in requests: where they are written, how they are read, and the limits they meet.

Clients send an image as OpenAI's content part
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` or as a markdown
image in TGI's `inputs` (`![](data:image/png;base64,...)`). The bytes are PNG, JPEG, WebP or
GIF (its first frame), decoded with Pillow into RGB. Every problem is a 422 that names the
field, the limit and the fix; nothing here lets a broken or oversized image reach a model.

The identity of an image is the hash of its decoded pixels (with their size), so the same
picture sent as PNG or re-encoded keeps one key for the prefix cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio.to_thread
import httpx

from tgis.server.http.errors import ApiError, invalid

if TYPE_CHECKING:
    from PIL.Image import Image

# What Pillow may open: a request names a format, and only these are decoded.
FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
MEDIA_TYPES = {f"image/{name}" for name in ("png", "jpeg", "jpg", "webp", "gif")}
# `![alt](url)` in TGI's inputs; the URL runs to the first closing parenthesis or space.
MARKDOWN_IMAGE = re.compile(r"!\[[^\]\n]*\]\(\s*([^)\s]+)\s*\)")
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w-]+=[\w.-]+)*)(;base64)?,", re.I)


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send: images, pixels per image (width × height after decoding),
    and encoded bytes per image."""

    max_images: int = 8
    max_pixels: int = 4096 * 4096
    max_bytes: int = 20_000_000


@dataclass(frozen=True)
class DecodedImage:
    """An image ready for a model's processor: RGB pixels, and the hash that identifies them."""

    image: Image
    digest: str  # sha256 of the size and the RGB bytes
    field: str  # where the request wrote it, for messages

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def data_url_bytes(url: str, field: str, limits: ImageLimits) -> bytes:
    """The bytes of a base64 `data:image/...` URL; a 422 naming `field` for anything else."""
    match = _DATA_URL.match(url)
    if match is None:
        raise invalid(
            f"`{field}` must be a data URL (`data:image/png;base64,...`); "
            f"got one starting {url[:24]!r}"
        )
    media_type = (match.group(1) or "").lower()
    if media_type not in MEDIA_TYPES:
        raise invalid(
            f"`{field}` is a data URL of {media_type or 'no type'!r}: send image/png, "
            "image/jpeg, image/webp or image/gif"
        )
    if match.group(3) is None:
        raise invalid(f"`{field}` must be base64-encoded (`data:{media_type};base64,...`)")
    payload = url[match.end() :]
    # base64 is 4 characters per 3 bytes: refuse before decoding what could not fit.
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise _too_large(field, len(payload) * 3 // 4, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid(f"`{field}` is not valid base64: {e}") from None
    if len(data) > limits.max_bytes:
        raise _too_large(field, len(data), limits)
    return data


def _too_large(field: str, size: int, limits: ImageLimits) -> ApiError:
    return invalid(
        f"`{field}` is {size} bytes; images may be at most {limits.max_bytes} bytes "
        "(the server's --max-image-bytes): send a smaller or more compressed image"
    )


def decode_image(data: bytes, field: str, limits: ImageLimits) -> DecodedImage:
    """Decode PNG, JPEG, WebP or GIF (the first frame) into RGB, within the pixel limit. The
    size is read from the header first, so an oversized image is refused before it is
    decoded (a decompression bomb never expands)."""
    from PIL import Image, UnidentifiedImageError

    too_many = f"images may have at most {limits.max_pixels} pixels (the server's --max-image-pixels): resize it"
    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS)) as opened:
            width, height = opened.size
            if width * height > limits.max_pixels:
                raise invalid(
                    f"`{field}` is {width}x{height} = {width * height} pixels; {too_many}"
                )
            opened.seek(0)  # a GIF's (or an animated WebP's) first frame
            image = opened.convert("RGB")
    except ApiError:
        raise
    except Image.DecompressionBombError:  # past Pillow's own bound, which is above ours
        raise invalid(f"`{field}` is larger than Pillow will open; {too_many}") from None
    except UnidentifiedImageError:
        raise invalid(f"`{field}` is not a PNG, JPEG, WebP or GIF image") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise invalid(f"`{field}` is a broken image: {e}") from None
    digest = hashlib.sha256(f"{width}x{height}:".encode() + image.tobytes()).hexdigest()
    return DecodedImage(image, digest, field)


def count_images(count: int, limits: ImageLimits) -> None:
    """Refuse a request with more images than the limit."""
    if count > limits.max_images:
        raise invalid(
            f"the request has {count} images; at most {limits.max_images} are allowed per "
            "request (the server's --max-images-per-request): send fewer"
        )


def markdown_images(text: str) -> list[tuple[int, int, str]]:
    """The markdown images of TGI's `inputs`: (start, end, url) of each `![...](url)`."""
    return [(m.start(), m.end(), m.group(1)) for m in MARKDOWN_IMAGE.finditer(text)]


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _public(address: IPAddress) -> bool:
    return address.is_global


@dataclass(frozen=True)
class UrlPolicy:
    """How remote images are fetched (only with --allow-image-urls: a server that fetches URLs
    for its clients can be turned against its own network). `allowed` decides which resolved
    addresses may be contacted: public ones only by default, never loopback, private,
    link-local (cloud metadata), multicast or reserved ones."""

    timeout_s: float = 10.0
    max_redirects: int = 3
    allowed: Callable[[IPAddress], bool] = _public


def resolved_addresses(host: str, port: int) -> list[IPAddress]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0])
        # An IPv4 address written as IPv6 (::ffff:10.0.0.1) is judged as the IPv4 one.
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        out.append(address)
    return out


async def fetch_image(url: str, field: str, limits: ImageLimits, policy: UrlPolicy) -> bytes:
    """The bytes of an http(s) image URL. Each hop's host is resolved and every address it
    resolves to must be allowed; the connection goes to the checked address (the host name
    kept for TLS and the Host header), so a second lookup cannot point elsewhere. Redirects
    are followed by hand, each checked the same way; the body is read up to the byte limit."""
    current = url
    async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
        for _ in range(policy.max_redirects + 1):
            parts = httpx.URL(current)
            if parts.scheme not in ("http", "https") or not parts.host:
                raise invalid(f"`{field}`: {current!r} is not an http(s) URL")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                found = await anyio.to_thread.run_sync(resolved_addresses, parts.host, port)
            except OSError as e:
                raise invalid(f"`{field}`: {parts.host!r} cannot be resolved ({e})") from None
            refused = [a for a in found if not policy.allowed(a)]
            if refused or not found:
                raise invalid(
                    f"`{field}`: {parts.host!r} resolves to {refused[0] if refused else 'nothing'}, "
                    "an address this server does not fetch from (only public addresses)"
                )
            pinned = parts.copy_with(host=str(found[0]))
            headers = {"host": parts.netloc.decode(), "accept": "image/*"}
            extensions = {"sni_hostname": parts.host} if parts.scheme == "https" else {}
            try:
                async with client.stream(
                    "GET", pinned, headers=headers, extensions=extensions
                ) as response:
                    if response.is_redirect:
                        location = response.headers.get("location")
                        if not location:
                            raise invalid(f"`{field}`: a redirect without a location")
                        current = str(parts.join(location))
                        continue
                    if response.status_code != 200:
                        raise invalid(f"`{field}`: fetching it answered {response.status_code}")
                    declared = response.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > limits.max_bytes:
                        raise _too_large(field, int(declared), limits)
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > limits.max_bytes:
                            raise _too_large(field, len(body), limits)
                    return bytes(body)
            except httpx.HTTPError as e:
                raise invalid(f"`{field}`: fetching {current!r} failed ({e})") from None
    raise invalid(f"`{field}`: more than {policy.max_redirects} redirects")


@dataclass(frozen=True)
class ImageRef:
    """An image a request names, not yet read: its URL and the field that wrote it."""

    url: str
    field: str


async def load_images(
    refs: list[ImageRef], limits: ImageLimits, policy: UrlPolicy | None
) -> list[DecodedImage]:
    """Read and decode a request's images, in order: data URLs at once, http(s) URLs fetched
    under `policy` (None: the server fetches none, and says how to send the image instead).
    The decoding runs in a worker thread."""
    count_images(len(refs), limits)
    out = []
    for ref in refs:
        if ref.url.startswith("data:"):
            data = data_url_bytes(ref.url, ref.field, limits)
        elif ref.url.lower().startswith(("http://", "https://")):
            if policy is None:
                raise invalid(
                    f"`{ref.field}` is a remote URL, and this server fetches none (it would "
                    "contact any address a client names): send the image as a data URL "
                    "(`data:image/png;base64,...`), or start the server with "
                    "--allow-image-urls"
                )
            data = await fetch_image(ref.url, ref.field, limits, policy)
        else:
            data = data_url_bytes(ref.url, ref.field, limits)  # names what a data URL is
        out.append(await anyio.to_thread.run_sync(decode_image, data, ref.field, limits))
    return out
