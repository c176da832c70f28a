// Open a page in headless Chromium and print what a reader would see, as JSON:
// node look_at_page.mjs file:///.../report.html screenshot.png
import chromium from "@sparticuz/chromium";
import puppeteer from "puppeteer-core";

const [url, screenshot] = process.argv.slice(2);
const browser = await puppeteer.launch({
  args: chromium.args,
  executablePath: await chromium.executablePath(),
  headless: true,
});
try {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  page.on("requestfailed", (r) => errors.push(`request failed: ${r.url().slice(0, 80)}`));
  await page.setViewport({ width: 1400, height: 1000 });
  const response = await page.goto(url, { waitUntil: "load" });
  const seen = await page.evaluate(() => ({
    title: document.title,
    summary: [...document.querySelectorAll("p.good, p.bad")].map((p) => p.innerText),
    rows: [...document.querySelectorAll("tr.pass, tr.fail")].map((r) => ({
      test: r.cells[0].innerText,
      verdict: r.cells[2].innerText,
      cls: r.className,
      color: getComputedStyle(r.cells[2]).color,
    })),
    pictures: [...document.querySelectorAll("figure.failure-picture")].map((f) => ({
      caption: f.querySelector("figcaption").innerText,
      charts: [...f.querySelectorAll("svg")].map((s) => ({
        name: s.getAttribute("class"),
        width: Math.round(s.getBoundingClientRect().width),
        height: Math.round(s.getBoundingClientRect().height),
        marks: s.querySelectorAll("rect, polyline").length,
      })),
    })),
    images: [...document.images].map((i) => ({
      alt: i.alt,
      complete: i.complete,
      naturalWidth: i.naturalWidth,
      naturalHeight: i.naturalHeight,
      shownWidth: i.getBoundingClientRect().width,
    })),
  }));
  const layout = await page.evaluate(lookAtLayout);
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });
  layout.scrolled = await page.evaluate(scrollTheTable);
  console.log(JSON.stringify({ ok: response.ok(), browser: await browser.version(), errors, ...seen, layout }));
} finally {
  await browser.close();
}

// (Both functions run in the page, on their own.)
// What sticks out of the window: the page's width, each element (outside the table's scroll
// box) whose right edge passes the window's, the box, and the failure texts.
function lookAtLayout() {
  const box = document.querySelector("table")?.parentElement;
  const right = (e) => Math.round(e.getBoundingClientRect().right);
  const name = (e) => e.tagName.toLowerCase() + (e.className ? `.${e.className}` : "");
  const lineCount = (e) => {  // the lines a text takes on screen: its own, and the pieces of those that wrap
    const range = document.createRange();
    range.selectNodeContents(e);
    return new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size;
  };
  const outside = [...document.querySelectorAll("body, body *")].filter((e) => e === box || !box.contains(e));
  return {
    innerWidth: window.innerWidth,
    pageScrollWidth: document.documentElement.scrollWidth,
    wider: outside.filter((e) => right(e) > window.innerWidth).map((e) => `${name(e)} ${right(e)}`),
    box: {
      tag: name(box),
      overflowX: getComputedStyle(box).overflowX,
      right: right(box),
      scrollWidth: box.scrollWidth,
      clientWidth: box.clientWidth,
    },
    tableWidth: Math.round(document.querySelector("table").getBoundingClientRect().width),
    failures: [...document.querySelectorAll("tr.detail pre")].map((p) => ({
      text: p.innerText,
      right: right(p),
      scrollWidth: p.scrollWidth,
      clientWidth: p.clientWidth,
      lines: lineCount(p),
    })),
  };
}

// The table scrolled so that its token_noise_ratio column is in the middle of its box: what
// is on top at the middle of that header, of the first column and of the failure texts.
function scrollTheTable() {
  const box = document.querySelector("table").parentElement;
  const headers = [...document.querySelectorAll("th")];
  const column = headers.find((h) => h.innerText === "token_noise_ratio");
  const boxRect = box.getBoundingClientRect();
  box.scrollLeft = column.offsetLeft - box.clientWidth / 2;
  const onTop = (e) => {
    const r = e.getBoundingClientRect();
    const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    return hit === e || e.contains(hit);
  };
  const firstCells = [...document.querySelectorAll("tr:not(.detail)")].map((r) => r.cells[0]);
  return {
    scrollLeft: box.scrollLeft,
    boxLeft: Math.round(boxRect.left),
    boxRight: Math.round(boxRect.right),
    column: { onTop: onTop(column), left: Math.round(column.getBoundingClientRect().left), right: Math.round(column.getBoundingClientRect().right) },
    firstColumn: firstCells.map((c) => ({
      position: getComputedStyle(c).position,
      background: getComputedStyle(c).backgroundColor,
      left: Math.round(c.getBoundingClientRect().left),
      onTop: onTop(c),
    })),
    failures: [...document.querySelectorAll("tr.detail pre")].map((p) => ({
      left: Math.round(p.getBoundingClientRect().left),
      right: Math.round(p.getBoundingClientRect().right),
    })),
  };
}
