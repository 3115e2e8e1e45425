// Explore's linked views: chip and plot clicks, dragged boxes -> #explore-action; app/tabs/explore/tab.py BRIDGE_JS.
() => {
  if (window.lmscopeBridge) return [];
  window.lmscopeBridge = true;
  const style = document.createElement('style');
  style.textContent = '#tokens [data-pos] { cursor: pointer; } #tokens .tok-query { outline: 2px solid #e4572e; outline-offset: 1px; }'
    // the lens's word strip and a cell's top 10 (app/tabs/explore/figures.py lens_strip_html, lens_topk_html)
    + ' .lens-strip { display: flex; flex-wrap: wrap; gap: 3px; font-size: 12px; }'
    + ' .lens-chip { display: inline-flex; flex-direction: column; padding: 1px 4px; border-radius: 4px; cursor: pointer; }'
    + ' .lens-chip.lens-query { outline: 2px solid #e4572e; } .lens-in { font-size: 10px; opacity: .65; }'
    + ' .lens-out { font-weight: 600; white-space: pre; } .lens-strip-legend, .lens-topk-head { font-size: 12px; opacity: .8; margin: 2px 0; }'
    + ' #lens-topk table.lens-topk { font-size: 12px; border-collapse: collapse; width: 100%; margin: 0; }'
    + ' #lens-topk table.lens-topk td, #lens-topk table.lens-topk th { padding: 1px 6px !important; border: none !important; line-height: 1.3; }'
    + ' #lens-topk table.lens-topk td.w { white-space: pre; font-weight: 600; } #lens-topk table.lens-topk td.bar { width: 40%; }'
    + ' #lens-topk table.lens-topk td.bar span { display: block; height: 9px; background: #3b75af; border-radius: 2px; }';
  document.head.appendChild(style);
  let seq = 0;
  const send = (msg) => {
    const box = document.querySelector('#explore-action textarea, #explore-action input');
    if (!box) return;
    msg.n = ++seq;  // every message differs from the last
    box.value = JSON.stringify(msg);
    box.dispatchEvent(new Event('input', {bubbles: true}));  // the component's value ...
    box.dispatchEvent(new KeyboardEvent('keypress', {key: 'x', bubbles: true}));  // ... and Gradio 6's input event
  };
  const num = (v) => { if (typeof v === 'string') { const m = v.match(/\d+/); return m ? +m[0] : null; }
                       return typeof v === 'number' ? Math.round(v) : null; };
  const meta = (gd) => (gd.layout && gd.layout.meta && gd.layout.meta.lmscope) || {};
  const span = (ax, a, b) => {  // a dragged range on an axis -> [first, last] position
    if (!ax || a === undefined || b === undefined) return null;
    let lo = Math.round(Math.min(a, b)), hi = Math.round(Math.max(a, b));
    if (ax.cat) { lo += ax.lo; hi += ax.lo; }
    lo = Math.max(ax.lo, lo); hi = Math.min(ax.hi, hi);
    return hi >= lo ? [lo, hi] : null;
  };
  document.addEventListener('click', (e) => {
    const chip = e.target.closest && e.target.closest('#tokens [data-pos]');
    if (chip) send({kind: 'query', pos: +chip.dataset.pos});
    const word = e.target.closest && e.target.closest('#lens-strip .lens-chip');
    if (word) send({kind: 'lens', layer: +word.dataset.layer, pos: +word.dataset.pos});
  });
  // The lens's cells show their word while one holds a few characters: the figure sends the whole
  // words in layout.meta.lmscope.words, and this cuts them to the width of a cell as drawn (none
  // when fewer than min_chars fit), again whenever the figure is new or its width changes.
  const fitLens = () => {
    const gd = document.querySelector('#lens .js-plotly-plot');
    const P = window.Plotly;
    if (!P || !gd || !gd.data || !gd.data[0] || !gd._fullLayout || !gd._fullLayout.xaxis) return;
    const m = meta(gd);
    if (m.kind !== 'lens' || !m.words || !m.words.length || !m.words[0].length) return;
    const t = gd.data[0];
    let fit = Math.floor((gd._fullLayout.xaxis._length / m.words[0].length - 2) / (m.char_px || 5.4));
    if (fit < (m.min_chars || 3)) fit = 0;
    if (t.lmscopeFit === fit) return;
    t.lmscopeFit = fit;  // restyle keeps this trace object; a new figure brings a new one
    // as figures.fit_word: a word that must be cut loses its leading ␣ first
    const cut = (w) => { let c = [...w]; if (fit <= 0) return '';
                         if (c.length > fit && c[0] === '␣') c = c.slice(1);
                         return c.length <= fit ? c.join('') : c.slice(0, fit - 1).join('') + '…'; };
    P.restyle(gd, {text: [m.words.map((row) => row.map(cut))]}, [0]);
  };
  const onClick = (gd, ev) => {
    const p = ev && ev.points && ev.points[0];
    if (!p) return;
    const m = meta(gd);
    if (m.kind === 'overview') send({kind: 'head', layer: num(p.y), head: num(p.x)});
    else if (m.kind === 'grid') send({kind: 'head', head: p.curveNumber});
    else if (m.kind === 'head') send({kind: 'query', pos: num(p.y)});
    else if (m.kind === 'lens') send({kind: 'lens', layer: num(p.y), pos: num(p.x)});
  };
  const onZoom = (gd, ev) => {
    const m = meta(gd);
    if (!ev || (m.kind !== 'head' && m.kind !== 'lens')) return;
    if (ev['xaxis.autorange'] === true || ev['yaxis.autorange'] === true) { send({kind: 'zoom'}); return; }
    const cols = span(m.x, ev['xaxis.range[0]'], ev['xaxis.range[1]']);
    const rows = m.kind === 'head' ? span(m.y, ev['yaxis.range[0]'], ev['yaxis.range[1]']) : cols;
    if (!cols && !rows) return;  // not a zoom (a resize, a pan of nothing)
    const whole = (ax) => ax ? [ax.lo, ax.hi] : null;
    send({kind: 'zoom', rows: rows || whole(m.y), cols: cols || whole(m.x)});
  };
  const bind = () => {
    for (const id of ['head-overview', 'head-grid', 'head-big', 'lens']) {
      const gd = document.querySelector('#' + id + ' .js-plotly-plot');
      if (!gd || !gd.on || gd.lmscopeBound) continue;
      gd.lmscopeBound = true;
      gd.on('plotly_click', (ev) => onClick(gd, ev));
      gd.on('plotly_relayout', (ev) => onZoom(gd, ev));
    }
    const q = document.querySelector('#query input[type=number]');
    const want = q ? q.value : null;
    for (const c of document.querySelectorAll('#tokens .tok-query')) if (c.dataset.pos !== want) c.classList.remove('tok-query');
    const chip = want !== null && document.querySelector('#tokens [data-pos="' + want + '"]');
    if (chip && !chip.classList.contains('tok-query')) chip.classList.add('tok-query');
  };
  // Plotly points gradients (colour bars) and clip paths at url(<page URL>#id) when the page has a
  // <base> (Gradio's has), with the URL of the moment the plot was made; once the URL changes (the
  // view state is mirrored into it) those references break and colour bars go blank. Re-point them.
  const fixUrls = () => {
    const base = location.href.split('#')[0];
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
      const old = gd._context && gd._context._baseUrl;
      if (!old || old === base) continue;
      gd._context._baseUrl = base;
      for (const el of gd.querySelectorAll('[style*="url("], [clip-path*="url("], [fill*="url("], [stroke*="url("]')) {
        for (const a of ['clip-path', 'fill', 'stroke']) {
          const v = el.getAttribute(a);
          if (v && v.includes(old)) el.setAttribute(a, v.split(old).join(base));
          const w = el.style.getPropertyValue(a);
          if (w && w.includes(old)) el.style.setProperty(a, w.split(old).join(base));
        }
      }
    }
  };
  setInterval(() => { bind(); fixUrls(); fitLens(); }, 300);
  return [];
}
