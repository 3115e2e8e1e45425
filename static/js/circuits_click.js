// A click on a node of Explore's attribution graph chooses it: its id goes to the hidden
// #circuits-click box; app/tabs/explore/circuits_panel.py CLICK_JS (loaded once with the page).
() => {
  if (window.lmscopeCircuitsClick) return [];
  window.lmscopeCircuitsClick = true;
  let seq = 0;
  const send = (id) => {
    const box = document.querySelector('#circuits-click textarea, #circuits-click input');
    if (!box) return;
    box.value = id + ':' + (++seq);  // every click differs from the last
    box.dispatchEvent(new Event('input', {bubbles: true}));
    box.dispatchEvent(new KeyboardEvent('keypress', {key: 'x', bubbles: true}));
  };
  setInterval(() => {
    const gd = document.querySelector('#circuits-graph .js-plotly-plot');
    if (!gd || !gd.on || gd.lmscopeNodeBound === gd.data) return;
    gd.lmscopeNodeBound = gd.data;  // a redraw (a new graph) binds again
    gd.removeAllListeners && gd.removeAllListeners('plotly_click');
    gd.on('plotly_click', (ev) => {
      const p = ev && ev.points && ev.points[0];
      if (p && typeof p.customdata === 'string') send(p.customdata);
    });
    gd.style.cursor = 'pointer';
  }, 300);
  return [];
}
