"""The games' frames for image observations (``modality="image"``), drawn offline with numpy and PIL.

* :func:`sokoban_frame`: the room as 16-pixel tiles (the reference's 6x6 room is 96x96x3):
  brown bricks are walls, dark grey is floor, a red outlined square is a target, a yellow crate is a
  box, a green crate is a box on a target, the blue figure is the player.
* :func:`card_table`: Gym Cards' 300x300x3 table: white cards with rank and suit on green felt,
  rows of cards under a label, and a line of text at the bottom.
* :func:`numberline_frame`: NumberLine's 300x300x3 line: ticks ``0..max_position``, the target a
  red flag above its tick, the position a blue marker under its tick.
* :func:`numberline_strip` (ours): the line seen from the marker, as a column of 28-pixel cells, one
  per offset ``-max_position..max_position`` from the top: the marker the blue middle cell, the target
  a red cell, the line light grey, past its ends dark grey. One cell is one image token of a
  Qwen2-VL-family processor.

Every frame is a uint8 ``[H, W, 3]`` array, a pure function of the state (PIL's bundled font, no
file and no download).
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["TILE", "CARD_TABLE_SIZE", "STRIP_CELL", "card_table", "numberline_frame", "numberline_strip", "sokoban_frame"]

TILE = 16
CARD_TABLE_SIZE = 300
STRIP_CELL = 28  # a Qwen2-VL-family image token: 2x2 patches of 14 pixels
SUITS = ("spades", "hearts", "diamonds", "clubs")

_FELT, _WHITE, _BLACK, _RED = (0, 110, 60), (255, 255, 255), (0, 0, 0), (200, 20, 20)


# ---------------------------------------------------------------------------------------- Sokoban
@functools.lru_cache(maxsize=1)
def _tiles() -> dict[str, np.ndarray]:
    """The six 16x16x3 Sokoban tiles by name: wall, floor, target, box, box_on_target, player."""
    def fill(color):
        return np.broadcast_to(np.array(color, np.uint8), (TILE, TILE, 3)).copy()

    wall = fill((160, 70, 40))  # bricks: mortar rows every 4 px, joints staggered by row
    wall[3::4, :] = (110, 110, 110)
    for r in range(0, TILE, 4):
        for c in range(((r // 4) % 2) * 4, TILE, 8):
            wall[r : r + 3, c] = (110, 110, 110)
    floor = fill((40, 40, 40))
    target = floor.copy()
    target[3:13, 3:13] = (200, 30, 30)
    target[5:11, 5:11] = (40, 40, 40)

    def crate(color):
        tile = floor.copy()
        tile[1:15, 1:15] = (90, 60, 20)  # the crate's dark edge
        tile[3:13, 3:13] = color
        eye = np.eye(10, dtype=bool)
        tile[3:13, 3:13][eye | eye[::-1]] = (90, 60, 20)  # the crate's cross
        return tile

    yy, xx = np.mgrid[:TILE, :TILE]

    def with_player(base):
        tile = base.copy()
        head = (yy - 4) ** 2 + (xx - 7.5) ** 2 <= 6.5
        body = (yy >= 7) & (yy <= 14) & (np.abs(xx - 7.5) <= 4 - (yy >= 12) * 1.5)
        tile[head | body] = (60, 120, 255)
        return tile

    return {"wall": wall, "floor": floor, "target": target, "box": crate((230, 180, 40)),
            "box_on_target": crate((60, 200, 60)), "player": with_player(floor),
            "player_on_target": with_player(target)}


def sokoban_frame(walls, targets, boxes, player, dim: tuple[int, int]) -> np.ndarray:
    """The room as a uint8 ``[rows * 16, cols * 16, 3]`` frame (cells are ``(row, col)``)."""
    tiles = _tiles()
    frame = np.empty((dim[0] * TILE, dim[1] * TILE, 3), dtype=np.uint8)
    for r in range(dim[0]):
        for c in range(dim[1]):
            cell, on_target = (r, c), (r, c) in targets
            if cell in walls:
                name = "wall"
            elif cell == player:
                name = "player_on_target" if on_target else "player"
            elif cell in boxes:
                name = "box_on_target" if on_target else "box"
            else:
                name = "target" if on_target else "floor"
            frame[r * TILE : (r + 1) * TILE, c * TILE : (c + 1) * TILE] = tiles[name]
    return frame


# ---------------------------------------------------------------------------------------- cards
@functools.lru_cache(maxsize=8)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _suit(draw, suit: str, cx: float, cy: float, r: float) -> None:
    """A suit symbol of radius ``r`` centred at ``(cx, cy)``, drawn as shapes (no glyphs needed)."""
    color = _RED if suit in ("hearts", "diamonds") else _BLACK
    if suit == "diamonds":
        draw.polygon([(cx, cy - r), (cx + 0.75 * r, cy), (cx, cy + r), (cx - 0.75 * r, cy)], fill=color)
        return
    if suit == "clubs":
        for dx, dy in ((0, -0.45), (-0.5, 0.15), (0.5, 0.15)):
            x, y = cx + dx * r, cy + dy * r
            draw.ellipse([x - 0.45 * r, y - 0.45 * r, x + 0.45 * r, y + 0.45 * r], fill=color)
    else:  # hearts point down, spades (a heart upside down) point up
        up = -1 if suit == "spades" else 1
        for dx in (-0.45, 0.45):
            x, y = cx + dx * r, cy - up * 0.3 * r
            draw.ellipse([x - 0.5 * r, y - 0.5 * r, x + 0.5 * r, y + 0.5 * r], fill=color)
        draw.polygon([(cx - 0.95 * r, cy - up * 0.15 * r), (cx + 0.95 * r, cy - up * 0.15 * r),
                      (cx, cy + up * r)], fill=color)
    if suit in ("spades", "clubs"):  # the stem
        draw.polygon([(cx, cy + 0.2 * r), (cx - 0.35 * r, cy + r), (cx + 0.35 * r, cy + r)], fill=color)


def _card(draw, x: float, y: float, w: float, h: float, card: tuple[str, str] | None) -> None:
    """One card at ``(x, y)``: white with its rank in the corner and large in the middle, and its
    suit; ``None`` draws the back (a face-down card)."""
    box = [x, y, x + w, y + h]
    radius = max(2, int(w // 10))
    if card is None:
        draw.rounded_rectangle(box, radius=radius, fill=(30, 60, 160), outline=_WHITE, width=2)
        for k in range(1, 4):
            draw.line([x + k * w / 4, y + 4, x + k * w / 4, y + h - 4], fill=(90, 120, 210), width=1)
        return
    rank, suit = card
    color = _RED if suit in ("hearts", "diamonds") else _BLACK
    draw.rounded_rectangle(box, radius=radius, fill=_WHITE, outline=_BLACK, width=2)
    corner = _font(max(8, int(w * 0.22)))
    draw.text((x + 0.08 * w, y + 0.04 * h), rank, fill=color, font=corner)
    big = _font(max(10, int(w * 0.45)))
    draw.text((x + w / 2, y + 0.42 * h), rank, fill=color, font=big, anchor="mm")
    _suit(draw, suit, x + w / 2, y + 0.78 * h, 0.13 * w)


def card_table(rows: list[tuple[str, list[tuple[str, str] | None]]], footer: str = "") -> np.ndarray:
    """A ``300x300x3`` table: each row a label and its cards (``(rank, suit)``, or None face down),
    rows stacked from the top, ``footer`` written at the bottom."""
    from PIL import Image, ImageDraw

    size, margin = CARD_TABLE_SIZE, 12
    image = Image.new("RGB", (size, size), _FELT)
    draw = ImageDraw.Draw(image)
    label_h, footer_h = (22 if any(label for label, _ in rows) else 0), 44
    row_h = (size - footer_h - margin) / max(1, len(rows))
    for k, (label, cards) in enumerate(rows):
        top = margin + k * row_h
        room = row_h - label_h - margin
        w = min(0.7 * room, (size - margin * (len(cards) + 1)) / max(1, len(cards)))
        h = w / 0.7
        top += (room - h) / 2  # centred in the row's height left free
        step = w + margin  # overlap the cards when a row is wider than the table
        if len(cards) > 1:
            step = min(step, (size - 2 * margin - w) / (len(cards) - 1))
        left = (size - (step * (len(cards) - 1) + w)) / 2
        for j, card in enumerate(cards):
            _card(draw, left + j * step, top + label_h, w, h, card)
        if label:
            draw.text((margin, top + label_h / 2 - 4), label, fill=_WHITE, font=_font(16), anchor="lm")
    if footer:
        draw.text((size / 2, size - footer_h / 2 - 2), footer, fill=_WHITE, font=_font(18), anchor="mm")
    return np.asarray(image, dtype=np.uint8).copy()


# ---------------------------------------------------------------------------------------- NumberLine
def numberline_frame(position: int, target: int, max_position: int) -> np.ndarray:
    """A ``300x300x3`` frame of the line ``0..max_position``: the target a red flag above its tick,
    the position a blue marker below it."""
    from PIL import Image, ImageDraw

    size, margin, y = CARD_TABLE_SIZE, 24, CARD_TABLE_SIZE // 2
    image = Image.new("RGB", (size, size), _WHITE)
    draw = ImageDraw.Draw(image)
    draw.line([margin, y, size - margin, y], fill=_BLACK, width=3)

    def x_of(value):
        return margin + value * (size - 2 * margin) / max(1, max_position)

    font = _font(14 if max_position < 20 else 9)
    for value in range(max_position + 1):
        x = x_of(value)
        draw.line([x, y - 8, x, y + 8], fill=_BLACK, width=2)
        draw.text((x, y + 70), str(value), fill=_BLACK, font=font, anchor="mm")
    tx = x_of(target)  # the flag: a pole and a pennant above the line
    draw.line([tx, y - 10, tx, y - 60], fill=_RED, width=3)
    draw.polygon([(tx, y - 60), (tx + 22, y - 51), (tx, y - 42)], fill=_RED)
    px = x_of(position)  # the marker: a triangle pointing up at the line
    draw.polygon([(px, y + 12), (px - 12, y + 40), (px + 12, y + 40)], fill=(30, 80, 230))
    return np.asarray(image, dtype=np.uint8).copy()


def numberline_strip(position: int, target: int, max_position: int) -> np.ndarray:
    """A ``28(2 max_position + 1) x 28 x 3`` frame of the line seen from the marker, as a column: cell
    ``k`` from the top is the offset ``k - max_position`` from the marker (the line's numbers grow
    downwards), so the marker is always the middle cell (blue), the target the red cell ``target -
    position`` below it (above when negative), the rest of the line light grey and the cells past its
    ends dark grey. The move is where the red cell lies: a reading of the frame alone. On the target (seen
    only with NumberLine's ``stop_action``: otherwise arriving ends the episode) the middle cell is red
    and the line green, a change of the whole frame that says "stop".

    A column, not a row: Qwen2-VL's M-RoPE gives an image's width the lowest rotary frequencies of a
    head and its height the next ones. At a head size of 32 (sections ``[4, 6, 6]``) and the hub
    models' theta 1e4 the width's turn by 0.0002-0.003 rad per token, so 19 cells side by side look
    alike to attention (trained on the expert's moves, a row stayed at 50% correct after 300 steps, a
    column reached 100% in 250). The bundled tiny VLM's theta 10 reads both in 100 steps
    (docs/vision.md); the vision task keeps the column its results were measured on."""
    colors = [(60, 60, 60)] * (2 * max_position + 1)
    line = (200, 200, 200) if position != target else (60, 190, 60)  # the line lights up green on the target
    for value in range(max_position + 1):
        colors[value - position + max_position] = line
    colors[max_position] = (30, 80, 230)
    colors[target - position + max_position] = _RED  # on the target the middle cell is red (it covers the marker)
    column = np.array(colors, dtype=np.uint8).repeat(STRIP_CELL, axis=0)  # [H, 3]
    return np.ascontiguousarray(np.broadcast_to(column[:, None, :], (column.shape[0], STRIP_CELL, 3)))
