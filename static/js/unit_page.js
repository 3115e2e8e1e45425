// A click on a neuron in the heatmap or bars opens its unit page; app/tabs/explore/unit_page.py UNIT_JS.
() => {
  if (window.lmscopeUnitBridge) return [];
  window.lmscopeUnitBridge = true;
  const open = (name) => {
    const acc = document.querySelector('#unit-page .label-wrap');
    if (acc && !acc.classList.contains('open')) acc.click();
    let tries = 0;
    const go = () => {  // a closed accordion draws its content only once opened
      const box = document.querySelector('#unit-id textarea, #unit-id input');
      const btn = document.querySelector('#unit-open');
      if (!box || !btn) { if (tries++ < 50) setTimeout(go, 100); return; }
      box.value = name;
      box.dispatchEvent(new Event('input', {bubbles: true}));
      setTimeout(() => btn.click(), 50);
    };
    go();
  };
  const layer = () => { const q = document.querySelector('#layer input[type=number]'); return q ? q.value : '0'; };
  const bind = () => {
    for (const [id, axis] of [['neurons', 'y'], ['neuron-bars', 'x']]) {
      const gd = document.querySelector('#' + id + ' .js-plotly-plot');
      if (!gd || !gd.on || gd.lmscopeUnitBound) continue;
      gd.lmscopeUnitBound = true;
      gd.on('plotly_click', (ev) => {
        const p = ev && ev.points && ev.points[0];
        const v = p && String(p[axis] || '');
        const m = v.match(/^n(\d+)$/);
        if (m) open('L' + layer() + 'N' + m[1]);
      });
    }
  };
  setInterval(bind, 400);
  return [];
}
